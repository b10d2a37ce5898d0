"""A small in-house expert-parallel MoE layer and its moebench adapter: the worked example of
docs/adding-a-library.md. `layer.py` is the kind of layer a team writes itself (a router, experts spread over the
ranks, tokens exchanged by a hand-rolled all-to-all); `adapter.py` verifies it through moebench's public protocol
alone (moebench.libraries.spec, moebench.parity.compare, moebench.parity.layout)."""
