"""The decode attention kernel's launches compile for Hopper as the engine runs them: each within its
register cap and without spilling, so as many programs share an SM as the launch was chosen for
(docs/design-notes.md, "KV in 8 bits"). benchmarks/decode_sass.py compiles with Triton's own ptxas
and cuobjdump, so no GPU is needed; a kernel change that made a launch spill fails here, not only in
a timing on the device."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Found without importing triton here: other test modules switch on its interpreter before their import.
TOOLS = Path(importlib.util.find_spec("triton").submodule_search_locations[0]) / "backends" / "nvidia" / "bin"

pytestmark = pytest.mark.skipif(not (TOOLS / "cuobjdump").exists() or not (TOOLS / "ptxas").exists(),
                                reason="this Triton carries no CUDA tools")


def compile_launch(tmp_path, *args) -> dict:
    out = tmp_path / "sass.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not interpret
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_sass.py"), *args, "--json", str(out)],
                   check=True, env=env, capture_output=True, text=True, timeout=600)
    return json.loads(out.read_text())


@pytest.mark.parametrize("cache,programs", [("int8", 6), ("fp8", 3), ("bf16", 5)])
def test_decode_launch_fits_its_programs_without_spills(tmp_path, cache, programs):
    result = compile_launch(tmp_path, "--cache", cache)
    assert result["stack"] == 0 and result["local"] == 0, result
    assert result["max_registers"] is None or result["reg"] <= result["max_registers"]
    assert result["programs_per_sm_by_registers"] >= programs, result
    assert result["loops"] and all(loop["mix"].get("HMMA", 0) > 0 for loop in result["loops"])


def test_whole_tiles_cut_the_int8_loop(tmp_path):
    """The unmasked loop over whole tiles runs fewer instructions a tile than the masked one."""
    whole = compile_launch(tmp_path, "--cache", "int8")["loops"][0]["instructions"]
    masked = compile_launch(tmp_path, "--cache", "int8", "--masked")["loops"][0]["instructions"]
    assert whole < 0.9 * masked, (whole, masked)


def test_loop_instructions_written_out(tmp_path):
    """--sass writes each loop's instructions, as many as the counts report, with its products in it."""
    sass = tmp_path / "loops.sass"
    result = compile_launch(tmp_path, "--cache", "fp8", "--sass", str(sass))
    bodies = sass.read_text().split("// loop ")[1:]
    assert len(bodies) == len(result["loops"])
    for body, loop in zip(bodies, result["loops"]):
        lines = body.strip().splitlines()
        assert len(lines) - 1 == loop["instructions"]
        assert sum("HMMA" in line for line in lines) == loop["mix"]["HMMA"]


@pytest.mark.parametrize("cache", ["fp8", "int8"])
def test_ptx_codes_move_the_value_tile_as_16_bit_values(tmp_path, cache):
    """With the codes converted through codes_as's PTX where they were loaded, the whole-tile loop
    transposes the value tile with ldmatrix rather than gathering its bytes one load at a time."""
    def loop0(*flags):
        sass = tmp_path / "loops.sass"
        compile_launch(tmp_path, "--cache", cache, *flags, "--sass", str(sass))
        return sass.read_text().split("// loop ")[1]

    ptx, cast = loop0("--ptx-codes", "on"), loop0("--ptx-codes", "off")
    assert "LDS.U8" not in ptx and "LDSM.16.MT88" in ptx
    assert "LDS.U8" in cast or "LDS.S8" in cast


def test_copy_waits_are_read_from_the_loops(tmp_path):
    """Each loop reports how many copy groups it leaves in flight where it waits for its tile: the
    masked loop compiled with three stages waits for the next tile only, with later copies still out."""
    masked = compile_launch(tmp_path, "--cache", "fp8", "--masked", "--stages", "3")["loops"][0]
    assert masked["copy_groups_left_at_wait"] is not None and masked["copy_groups_left_at_wait"] > 0, masked
    loops = compile_launch(tmp_path, "--cache", "fp8")["loops"]
    assert all(isinstance(loop["copy_groups_left_at_wait"], int) for loop in loops), loops
