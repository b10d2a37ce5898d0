"""moebench.parity.noise: the bf16 noise-model judge shared by the DeepSpeed and transformers rows."""

from __future__ import annotations

import math

import torch

from moebench.parity import noise


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.bfloat16().float()


def test_distance_and_fit_read_off_the_sums():
    g = torch.Generator().manual_seed(0)
    e = torch.randn(64, 32, generator=g)
    assert noise.distance(noise.sums([(e, e)])) == 0.0
    assert math.isclose(noise.distance(noise.sums([(2 * e, e)])), 1.0, rel_tol=1e-9)
    c, resid = noise.fit(noise.sums([(3 * e, e)]))
    assert math.isclose(c, 3.0, rel_tol=1e-9) and resid < 1e-7
    # two tensors summed as one: the same as the distance of their concatenation
    a, b = torch.randn(10, generator=g), torch.randn(7, generator=g)
    two = noise.sums([(a, 0.9 * a), (b, 1.1 * b)])
    assert math.isclose(noise.distance(two), noise.distance(noise.sums([(torch.cat([a, b]), torch.cat(
        [0.9 * a, 1.1 * b]))])), rel_tol=1e-12)
    assert noise.distance(noise.sums([(e, torch.zeros_like(e))])) == math.inf and noise.fit(torch.zeros(3)) is None


def test_weights_count_a_parameter_held_by_several_ranks_once():
    e = torch.ones(4)
    once = noise.sums([(2 * e, e)])
    on_four_ranks = sum(noise.sums([(2 * e, e)], 1 / 4) for _ in range(4))
    assert torch.allclose(once, on_four_ranks)


def test_rounding_passes_and_a_wrong_share_fails_the_judge():
    """bf16 rounding of the same numbers stays within the ratio; a group scaled by 2 (expert gradients divided
    by the wrong group's size) is far outside it, and the fit names the scaled group alone."""
    g = torch.Generator().manual_seed(1)
    experts, router = torch.randn(8, 32, 16, generator=g), torch.randn(8, 32, generator=g)
    baseline = noise.sums([(_bf16(experts), experts), (_bf16(router), router)])
    rounded = noise.sums([(_bf16(experts * (1 + 1e-3)), experts), (_bf16(router), router)])
    ok = noise.judge("step 1", "gradient", rounded, baseline)
    assert ok.passed and ok.asserted and "ratio" in ok.note
    wrong = noise.sums([(_bf16(2 * experts), experts), (_bf16(router), router)])
    bad = noise.judge("step 1", "gradient", wrong, baseline, rank=0)
    assert not bad.passed and bad.name.startswith("step 1: bf16 noise model: gradient's distance from fp32")
    scaled, right = noise.scaled_groups({"experts": noise.sums([(_bf16(2 * experts), experts)]),
                                         "router": noise.sums([(_bf16(router), router)])})
    assert set(scaled) == {"experts"} and abs(scaled["experts"] - 2) < 0.01 and right == {"router"}
    # half of a tensor wrong fits no single factor: neither scaled nor right
    half = experts.clone()
    half[:4] = 0
    scaled, right = noise.scaled_groups({"experts": noise.sums([(half, experts)])})
    assert scaled == {} and right == set()


def test_groups_share_one_factor_when_they_agree_relatively():
    """0.17.6's bf16 loss scale shows as 65439-65570 across the groups: one factor (0.2 % apart), which an
    absolute spread would have refused; 2 and 4 are two factors."""
    assert abs(noise.common_factor({"experts": 65438.9, "gate": 65531.2, "dense": 65569.8}) - 65513.3) < 0.1
    assert noise.common_factor({"experts": 2.0, "router": 4.0}) is None and noise.common_factor({}) is None
