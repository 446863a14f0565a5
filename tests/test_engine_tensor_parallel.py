"""Tensor parallelism on CPU: each rank holds exactly its share of the weights, and two gloo
processes give the same greedy tokens as one, with full KV and with compression."""

from __future__ import annotations

import signal

import pytest
import torch

from conftest import assert_pool_empty, greedy, random_prompts
from zipage.engine import LLM
from zipage.engine.loading.loader import resolve_model
from zipage.engine.execution.models import CausalLM
from zipage.engine.execution.models.parallel import TensorParallel

FAMILIES = ("llama-tiny", "qwen2-tiny", "qwen3-tiny")


def _expected_share(name: str, full: torch.Tensor, model: CausalLM, rank: int, size: int) -> torch.Tensor:
    """What rank `rank` should hold of the full tensor, written out independently of the loader."""
    cfg = model.config
    d = model.attention_layers[0].head_dim
    q, kv, inter = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.intermediate_size

    def part(t, n, dim=0):
        return t.narrow(dim, rank * (n // size), n // size)

    if "qkv_proj" in name:
        qt, kt, vt = full.split([q, kv, kv])
        return torch.cat([part(qt, q), part(kt, kv), part(vt, kv)])
    if "gate_up_proj" in name:
        return torch.cat([part(full[:inter], inter), part(full[inter:], inter)])
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return part(full, full.shape[1], dim=1)
    if name.endswith("o_proj.bias"):
        return full if rank == 0 else torch.zeros_like(full)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = -(-cfg.vocab_size // size)
        padded = torch.cat([full, full.new_zeros((rows * size - full.shape[0], full.shape[1]))])
        return padded[rank * rows:(rank + 1) * rows]
    return full


@pytest.mark.parametrize("family", FAMILIES)
def test_each_rank_loads_its_share(tiny_models, family):
    size = 2  # the tiny models have 2 KV heads
    cfg = resolve_model(tiny_models[family].path).hf_config
    source = resolve_model(tiny_models[family].path)
    full = CausalLM(cfg)
    full.load_weights(source.load_weights())
    for rank in range(size):
        shard = CausalLM(cfg, TensorParallel(rank, size))
        shard.load_weights(source.load_weights())
        ours = dict(full.named_parameters())
        for name, param in shard.named_parameters():
            assert torch.equal(param, _expected_share(name, ours[name], full, rank, size)), (family, rank, name)


@pytest.mark.parametrize("family", FAMILIES)  # llama-tiny has llama3 RoPE scaling, computed by transformers
def test_random_init_draws_the_same_model_in_shares(family):
    cfg = resolve_model(f"random:{family}").hf_config
    full = CausalLM(cfg)
    full.init_random(7)
    ours = dict(full.named_parameters())
    for rank in range(2):
        shard = CausalLM(cfg, TensorParallel(rank, 2))
        shard.init_random(7)
        for name, param in shard.named_parameters():
            assert torch.equal(param, _expected_share(name, ours[name], full, rank, 2)), (rank, name)


def test_sizes_that_do_not_divide_are_refused_before_any_process_starts(tiny_path):
    with pytest.raises(ValueError, match="tensor_parallel_size=3: the model's attention heads"):
        LLM(tiny_path, device="cpu", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        LLM(tiny_path, device="cpu", tensor_parallel_size=0)


KNOBS = dict(device="cpu", block_size=16, window=8, max_cache_blocks_per_seq=3, num_kv_blocks=96)


def _generate(path, tp, compression, prompts, max_tokens):
    llm = LLM(path, tensor_parallel_size=tp, compression=compression, **KNOBS)
    try:
        outs = llm.generate(prompts, greedy(max_tokens, ignore_eos=True))
        assert_pool_empty(llm.engine)
        compressions = llm.engine.totals["compressions"]
        workers = llm.engine.tp_workers
    finally:
        llm.engine.close()
    if workers is not None:  # the other ranks stopped with the engine
        assert all(not p.is_alive() for p in workers.processes)
    return [o.token_ids for o in outs], compressions


@pytest.mark.parametrize("family,compression", [("qwen3-tiny", True), ("qwen3-tiny", False), ("qwen2-tiny", True)])
def test_two_ranks_give_the_tokens_of_one(tiny_models, family, compression):
    path = tiny_models[family].path
    prompts = random_prompts(4, (5, 70), seed=3)
    one, c1 = _generate(path, 1, compression, prompts, 90)
    two, c2 = _generate(path, 2, compression, prompts, 90)
    assert len({tuple(t) for t in one}) > 1 and len(set(one[0])) > 3  # varied output, a real check
    assert two == one
    assert c2 == c1
    assert (c1 > 0) == compression  # with compression on, prompts and outputs outgrow the budget


def test_a_script_without_a_main_guard_gets_a_clear_error(tmp_path, tiny_path):
    """Spawned workers re-import the script; unguarded, each worker fails while starting."""
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text(f"from zipage.engine import LLM\nLLM({tiny_path!r}, device='cpu', tensor_parallel_size=2)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          cwd=str(tmp_path), env={**__import__("os").environ})
    assert done.returncode != 0
    assert "failed to start" in done.stderr and "__main__" in done.stderr


def test_a_stopped_rank_is_a_clear_error(tiny_path):
    llm = LLM(tiny_path, tensor_parallel_size=2, **KNOBS)
    try:
        worker = llm.engine.tp_workers.processes[0]
        worker.kill()
        worker.join()
        out = llm.generate([1, 2, 3], greedy(5))[0]
        assert out.finish_reason == "error" and "tensor-parallel worker" in out.error
        assert_pool_empty(llm.engine)
    finally:
        llm.engine.close()


def test_ctrl_c_leaves_no_worker_behind(tmp_path, tiny_path):
    """SIGINT to the whole process group (what Ctrl-C does) ends rank 0 and every worker."""
    import os
    import subprocess
    import sys
    import time

    script = tmp_path / "serve.py"
    script.write_text(
        "import faulthandler, signal\n"
        "faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks on stderr, should it hang\n"
        "from zipage.engine import LLM, SamplingParams\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM({tiny_path!r}, device='cpu', tensor_parallel_size=2)\n"
        "    print(*[p.pid for p in llm.engine.tp_workers.processes], flush=True)\n"
        "    while True:\n"
        "        llm.generate([1, 2, 3], SamplingParams(max_tokens=8))\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, preexec_fn=_default_sigint)
    try:
        worker_pids = [int(p) for p in proc.stdout.readline().split()]
        assert worker_pids, proc.stderr.read()
        time.sleep(1.0)  # let it serve a little
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            workers = {pid: _state(pid) for pid in worker_pids}
            os.killpg(proc.pid, signal.SIGUSR1)  # rank 0 and the workers print their stacks
            time.sleep(2)
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"rank 0 did not exit on SIGINT; workers {workers}; signals of this process "
                        f"{_signals(os.getpid())}; the stacks:\n"
                        + proc.communicate()[1][-12000:])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.time() + 30
    while time.time() < deadline and any(_running(pid) for pid in worker_pids):
        time.sleep(0.2)
    assert not any(_running(pid) for pid in worker_pids), "a worker outlived the engine"


def _default_sigint() -> None:
    """The child starts as from a terminal, with Ctrl-C at its default, whatever this process
    (pytest, after many tests) has ignored or blocked: children inherit both."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _signals(pid: int) -> str:
    """The blocked and ignored signal masks of a process, from /proc."""
    with open(f"/proc/{pid}/status") as f:
        return " ".join(line.strip() for line in f if line.startswith(("SigBlk", "SigIgn")))


def _state(pid: int) -> str:
    """A process's state letter and what it waits in (wchan), or "gone"."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/{pid}/wchan") as f:
            return f"{state} {f.read()}"
    except FileNotFoundError:
        return "gone"


def _running(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
