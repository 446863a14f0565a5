"""--decode-launch (benchmarks/bench_common.py), which the GPU scripts share to time and check a
decode attention launch end to end before it becomes a cache kind's default: specs change exactly
the named fields of the named kind, and a bad spec stops the run with what was wrong."""

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere below

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from zipage.kernels import triton_attention as tatt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_common  # noqa: E402


@pytest.fixture
def launches(monkeypatch):
    """The committed launches, restored after the test."""
    monkeypatch.setattr(tatt, "DECODE_LAUNCH", dict(tatt.DECODE_LAUNCH))
    return dict(tatt.DECODE_LAUNCH)


def parse(*argv):
    parser = bench_common.parser("a script", "random:qwen3-0.6b")
    bench_common.add_decode_launch_flag(parser)
    return bench_common.parse_args(parser, list(argv))


def test_specs_change_the_named_fields_of_the_named_kind(launches):
    args = parse("--decode-launch", "fp8:tma=on,table_ahead=16,stages=3", "--decode-launch", "model:whole_tiles=on",
                 "--decode-launch", "int8:max_registers=none")
    result = bench_common.set_decode_launches(args.decode_launch)
    fp8 = tatt.decode_launch(torch.float8_e4m3fn)
    assert (fp8.tma, fp8.table_ahead, fp8.stages) == (True, 16, 3)
    assert (fp8.warps, fp8.fp16_products) == (launches[torch.float8_e4m3fn].warps, True)  # the rest kept
    assert tatt.decode_launch(torch.bfloat16).whole_tiles and not tatt.decode_launch(torch.bfloat16).tma
    assert tatt.decode_launch(torch.int8).max_registers is None
    assert result["fp8"]["table_ahead"] == 16 and result["model"]["whole_tiles"] is True


@pytest.mark.parametrize("spec,message", [
    ("fp9:tma=on", "CACHE one of model, fp8, int8"),
    ("fp8", "CACHE one of"),
    ("fp8:speed=11", "FIELD one of"),
    ("fp8:tma=yes", "tma is a switch: on or off"),
    ("fp8:stages=three", "stages takes a whole number"),
    ("fp8:table_ahead=12", "table_ahead=12"),
    ("int8:warps=3", "warps=3"),
])
def test_a_bad_spec_stops_with_what_was_wrong(launches, spec, message):
    with pytest.raises(SystemExit, match=message):
        bench_common.set_decode_launches([spec])
    assert tatt.DECODE_LAUNCH == launches


def test_a_launch_checks_its_own_values():
    with pytest.raises(ValueError, match="stages=0"):
        tatt.DecodeLaunch(4, stages=0)
    with pytest.raises(ValueError, match="tile=48"):
        tatt.DecodeLaunch(4, tile=48)
    assert tatt.DecodeLaunch(2, table_ahead=8).table_ahead == 8
