"""Write tests/data/bnb_dynamic_maps.json: bitsandbytes' dynamic quantization maps, the oracle that
tests/test_quant.py::test_dynamic_codebook_equals_bitsandbytes_maps holds pagedopt's codebooks to.

bitsandbytes is not a dependency of pagedopt; run this with a throwaway venv that has it:

    pip download --no-deps bitsandbytes==0.50.2 -d /tmp/bnbwhl
    python -m venv --system-site-packages /tmp/bnbvenv
    /tmp/bnbvenv/bin/pip install --no-deps /tmp/bnbwhl/*.whl
    /tmp/bnbvenv/bin/python scripts/make_bnb_codebook_fixture.py

bitsandbytes.functional.create_dynamic_map runs on the CPU. Each map is stored as 256 float32
values written exactly, as float.hex() of the float32 value.
"""
import json
import sys
from pathlib import Path

import bitsandbytes
import torch
from bitsandbytes.functional import create_dynamic_map

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "bnb_dynamic_maps.json"


def main() -> None:
    maps = {}
    for name, signed in (("signed", True), ("unsigned", False)):
        code = create_dynamic_map(signed=signed)
        assert code.dtype == torch.float32 and code.numel() == 256, (code.dtype, code.numel())
        maps[name] = [float(x).hex() for x in code.tolist()]  # float32 -> float64 is exact
    fixture = {
        "source": f"bitsandbytes {bitsandbytes.__version__}: bitsandbytes.functional.create_dynamic_map"
                  "(signed=True) and create_dynamic_map(signed=False), defaults max_exponent_bits=7, total_bits=8",
        "generator": "scripts/make_bnb_codebook_fixture.py",
        "torch": torch.__version__,
        "format": "256 float32 values per map, ascending, each as float.hex()",
        **maps,
    }
    OUT.write_text(json.dumps(fixture, indent=1) + "\n")
    print(f"wrote {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
