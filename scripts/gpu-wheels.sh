#!/usr/bin/env bash
# Make a wheel folder for `make gpu-check WHEELS=DIR` on a GPU machine without network.
#
#   scripts/gpu-wheels.sh DIR [PYTHON_VERSION]      # run on a machine with network, in the checkout
#
# DIR gets moebench's dependencies (and theirs) at the versions moebench/constraints.txt pins (the
# rest as pip resolves them), as wheels for CPython PYTHON_VERSION (default 3.12) on x86-64 Linux:
# binary wheels from the index, and a wheel built here for a package published as source only
# (DeepSpeed). Never torch or what torch itself depends on (triton, the nvidia-* CUDA libraries,
# sympy, ...): the GPU machine's own are used.
# SKIP='regex' leaves out more names (packages the GPU machine already has), e.g.
#   SKIP='numpy|matplotlib|pillow|fonttools|contourpy|kiwisolver|pyparsing|cycler|python-dateutil|six'
# PIP_PYTHON (default .venv/bin/python, from `make install`) resolves the set and builds the wheels.
set -euo pipefail
dir=${1:?usage: scripts/gpu-wheels.sh DIR [PYTHON_VERSION]}
pyver=${2:-3.12}
py=${PIP_PYTHON:-.venv/bin/python}
# torch, and what every torch install brings with it (its own dependencies)
never='moebench|torch|triton|nvidia-.*|cuda-bindings|cuda-pathfinder|cuda-toolkit|sympy|mpmath|networkx|jinja2|markupsafe|filelock|fsspec'
skip="^(${never}${SKIP:+|$SKIP})$"
mkdir -p "$dir"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# 1. The whole set, resolved as an install into an empty environment would be (nothing is installed).
"$py" -m pip install --quiet --dry-run --ignore-installed --report "$tmp/report.json" \
    -c moebench/constraints.txt -e . >/dev/null
"$py" - "$tmp/report.json" "$skip" > "$tmp/wanted.txt" <<'EOF'
import json, re, sys
report, skip = json.load(open(sys.argv[1])), re.compile(sys.argv[2])
for item in report["install"]:
    name = re.sub(r"[-_.]+", "-", item["metadata"]["name"]).lower()
    if not skip.match(name):
        print(f"{name}=={item['metadata']['version']}")
for tool in ("setuptools", "wheel"):  # what --no-build-isolation builds moebench with, if the machine lacks it
    print(tool)
EOF

# 2. Each one as a wheel for the GPU machine's Python; a source-only one is built into a wheel here.
platforms=()
for n in 2_39 2_35 2_34 2_31 2_28 2_27 2_24 2_17; do platforms+=(--platform "manylinux_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
built=()
while read -r req; do
    if ! "$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$pyver" \
            --implementation cp "${platforms[@]}" -d "$dir" "$req" 2>/dev/null; then
        "$py" -m pip wheel --quiet --no-deps --no-build-isolation -w "$dir" "$req"
        built+=("$req")
    fi
done < "$tmp/wanted.txt"
count=$(ls "$dir"/*.whl | wc -l)
size=$(du -sh "$dir" | cut -f1)
echo "$dir: $count wheels, $size (built here: ${built[*]:-none}); for CPython $pyver, x86-64 Linux, no torch"
