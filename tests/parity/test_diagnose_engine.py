"""Issue 38's engine, for every adapter: two known-wrong answers at once named as both, NaN never noise, and a row
whose two runs differ named nondeterministic."""

from __future__ import annotations

import math

import pytest
import torch

from moebench.parity.compare import STRICT, Comparison, assertion, compare
from moebench.parity.diagnose import diagnose


def test_two_known_wrong_answers_together_are_named_as_both():
    torch.manual_seed(0)
    right = torch.randn(6, 4)
    missing_share = right.clone()
    missing_share[:2] = 0  # one mechanism: the first rows lose their share
    leak = right + 0.3 * torch.randn(6, 4).abs()  # another: every element gains a leak
    both = missing_share + (leak - right)
    found = diagnose(both, right, atol=1e-6, rtol=1e-5,
                     alternatives={"a": (missing_share, "a missing share", "rank-local"),
                                   "b": (leak, "a leak", "unrouted-slots")})
    assert found["name"] == "rank-local+unrouted-slots", found
    assert "both at once" in found["sentence"] and found["details"]["composite"] == ["rank-local", "unrouted-slots"]
    # one alone is still named alone, and nothing is named when neither helps
    assert diagnose(leak, right, atol=1e-6, rtol=1e-5, alternatives={"b": (leak, "a leak", "unrouted-slots")}
                    )["name"] == "unrouted-slots"
    assert diagnose(right + torch.randn(6, 4), right, atol=1e-6, rtol=1e-5,
                    alternatives={"a": (missing_share, "x", "rank-local"), "b": (leak, "y", "unrouted-slots")}
                    )["name"] == "unexplained"


def test_two_mechanisms_that_interact_are_named_as_both_through_together():
    """Two known-wrong answers whose errors do not add (one cuts what the other leaks, on some rows): the pair
    search misses them; the caller's reference with both applied, given through `together`, names both."""
    from moebench.parity.diagnose import together

    torch.manual_seed(1)
    right = torch.randn(6, 4)
    leak = 0.3 * torch.randn(6, 4).abs()
    rank_local = right.clone()
    rank_local[:3] = 0  # this rank's own rows kept, the others cut
    both = rank_local + leak
    both[:3] = 0  # the cut takes the leak with it there: not rank_local + (right + leak) - right
    alternatives = {"a": (rank_local, "a missing share", "rank-local"),
                    "b": (right + leak, "a leak", "unrouted-slots")}
    assert diagnose(both, right, atol=1e-6, rtol=1e-5, alternatives=alternatives)["name"] == "unexplained"
    joint = together(both, ("a leak", "unrouted-slots"), ("a missing share", "rank-local"), "why")
    found = diagnose(both, right, atol=1e-6, rtol=1e-5, alternatives={**alternatives, "ab": joint})
    assert found["name"] == "rank-local+unrouted-slots" and found["details"]["composite"] == ["rank-local",
                                                                                               "unrouted-slots"]
    assert found["sentence"].endswith("at once (neither alone explains it) would give: why"), found
    # the joint reference names nothing it does not match
    other = both.clone()
    other[4] += 1.0
    assert diagnose(other, right, atol=1e-6, rtol=1e-5, alternatives={**alternatives, "ab": joint}
                    )["name"] != "rank-local+unrouted-slots"


def test_a_nan_distance_is_never_low_precision_noise():
    from moebench.parity.final import never_noise
    from moebench.parity.noise import judge, sums

    ref = torch.randn(16)
    run = ref.clone()
    run[3] = math.nan
    judged = judge("step 1", "gradient", sums([(run, ref)]), sums([(ref + 1e-3, ref)]), rank=1, precision="fp16")
    assert not judged.passed and not judged.finite and "NaN or Inf" in judged.note
    renamed = never_noise({"name": "fp16-noise", "sentence": "distance from fp32 nan", "details": {}}, [judged])
    assert renamed["name"] == "non-finite" and "never fp16-noise" in renamed["sentence"], renamed
    # a finite failure keeps its noise name, and a named mechanism is never overridden
    far = judge("step 1", "gradient", sums([(ref * 2, ref)]), sums([(ref + 1e-3, ref)]), precision="bf16")
    assert never_noise({"name": "bf16-noise", "sentence": "", "details": {}}, [far])["name"] == "bf16-noise"
    assert never_noise({"name": "loss-scale", "sentence": "", "details": {}}, [judged])["name"] == "loss-scale"


def test_an_unexplained_failure_with_nan_in_fp32_is_non_finite():
    from moebench.parity.final import never_noise

    c = compare("grad", torch.tensor([1.0, math.nan]), torch.tensor([1.0, 2.0]), STRICT, rank=0)
    assert never_noise({"name": "unexplained", "sentence": "", "details": {}}, [c])["name"] == "non-finite"


@pytest.mark.multirank
def test_a_row_whose_two_runs_differ_is_named_nondeterministic():
    """The runner draws from the OS's entropy (as code reading uninitialised memory does): every run differs."""
    import os

    from moebench.libraries.spec import PARITY, Adapter, Row
    from moebench.testing import run_rows

    def run(ctx, row, opts):
        noise = torch.tensor(list(os.urandom(4)), dtype=torch.float32) / 255  # never twice the same
        return [compare("output", torch.ones(4) + 0.5 + noise, torch.ones(4), STRICT)]

    class Flaky(Adapter):
        name, import_name = "flaky", "torch"
        runners = {PARITY: run}

        def version(self):
            return "test"

        def rows(self, world_size, *, resume=False, user_config=None):
            return [Row(library="flaky", model="m", backend="-", ep_mode="-", world_size=world_size)]

    (record,) = run_rows(Flaky(), world_size=2)
    assert record["verdict"] == "fail" and record["diagnosis_name"] == "nondeterministic", record
    assert "two runs with the same seed differ" in record["diagnosis"]


def test_a_deterministic_failure_is_not_called_nondeterministic():
    from moebench.parity.final import nondeterminism
    from moebench.parity.runner import CheckRecord

    def record(diff):
        c = Comparison(name="x", passed=False, rank=0, max_abs_diff=diff)
        return CheckRecord(name="c", status="fail", seed_source="", description="", catches="", world_size=2,
                           elapsed_s=0.0, comparisons=[c.to_dict(), assertion("y", True, rank=1).to_dict()])

    assert nondeterminism(record(0.5), record(0.5)) is None
    assert nondeterminism(record(0.5), record(0.25))["name"] == "nondeterministic"
