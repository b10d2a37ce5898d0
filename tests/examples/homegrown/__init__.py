"""Two expert-parallel MoE layers of designs other than the in-house example, each with its five known bugs, for the
layer harness's tests (tests/libraries/test_layer_harness.py):

- gather.py: softmax then top-2 with renormalised weights, experts stacked in two parameters (w1: [E_local, d, h],
  w2: [E_local, h, d]) laid out contiguously, dispatch by an all-gather of the tokens and their routing weights with
  a hand-written backward, combine by "sum over the ranks, keep my rows";
- sigmoid.py: sigmoid scores, top-1, a ModuleList of bias-free SwiGLU experts laid out strided (rank r holds
  experts r, r + W, ...), dispatch and combine by all_to_all_single with uneven splits and a hand-written backward.

BUGS: each layer takes `bug=` one of them (or None: the right layer):
- "expert-grads-summed": the gradient sync leaves the experts' gradients summed over the ranks (not / W);
- "router-not-reduced": the gradient sync never all-reduces the router's gradient;
- "weights-detached": the combine weights are detached from the router;
- "exchange-backward-local": the exchange's backward keeps only this rank's own share (gather: no reduction over
  the ranks; all-to-all: only the slots it exchanged with itself);
- "wrong-expert-map": the dispatch maps local slots to global experts by the other layout than the weights'.
"""

BUGS = ("expert-grads-summed", "router-not-reduced", "weights-detached", "exchange-backward-local",
        "wrong-expert-map")
