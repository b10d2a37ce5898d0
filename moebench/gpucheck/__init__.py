"""`moebench gpu-check` (and `make gpu-check`): the chapter on its own hardware, in one command.

    preflight.py  is there a CUDA GPU? (refuses in one line, exit 2, creating nothing)
    install.py    moebench beside the machine's own torch, offline from a wheel folder (WHEELS=)
    steps.py      the steps as data: name, what it checks, its command, its budget
    build.py      the chapter's fastmoe pitfalls, then fastmoe built from FASTMOE_SRC
    layers.py     real fmoe vs moebench's reference layer, gate by gate
    gpubench.py   one MoE layer on the GPU: TFLOP/s and share of the datasheet peak (peaks.py)
    judge.py      what each step's output is reduced to, and the derived verdicts
    runner.py     runs the steps with deadlines into results/gpu-check/<run-id>/

preflight.py and install.py use the standard library only (the Makefile runs them before
moebench's dependencies exist); nothing here imports the CLI.
"""
