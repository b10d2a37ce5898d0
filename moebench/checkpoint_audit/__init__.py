"""`moebench checkpoint`: audit an expert-parallel checkpoint on disk, on CPU, one tensor at a time.

Rooms: `detect` (which format a folder holds; refusals), one reader per format (`read_dcp`, `read_deepspeed`,
`read_safetensors`) yielding the same stream (`stream.Stored`), `experts` (experts by layout), `audit` and
`optimizer` (the checks), `against` (two checkpoints expert by expert), `run` (the one core call). No Typer here.
The Python API's `moebench.checkpoint(path, ...)` (moebench/api.py) calls `run.checked_audit`; the package has
another name so that importing it never shadows that function.
"""
