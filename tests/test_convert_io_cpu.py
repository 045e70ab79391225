"""The conversion's CPU use: what is written stays the bytes of the plain torch recipe, with
torch's threads splitting the work, and the convert command leaves its objects to the OS at
exit."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from gqakit.convert import convert_checkpoint


@pytest.fixture
def threads():
    """Torch's intra-op thread count, put back after the test."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_mean_output_is_the_bytes_of_the_plain_torch_recipe(tiny_model, tmp_path, dtype, threads):
    """Every tensor bit for bit: unchanged ones are the source's, each pooled K/V the group mean
    taken in float32 (float64 for a float32 source) and rounded once to the source dtype. K and
    V hold 65,536 values, above torch's grain for splitting an op across threads, so two
    threads split the pooling."""
    torch.set_num_threads(2)
    src = tiny_model("llama", hidden_size=256, intermediate_size=64, num_attention_heads=8, num_key_value_heads=8,
                     dtype=dtype)
    G = 2
    got = tensors(convert_checkpoint(src, tmp_path / "out", G, method="mean", progress=False))
    before = tensors(src)
    wide = torch.float64 if dtype == torch.float32 else torch.float32
    pooled = 0
    assert set(got) == set(before)
    for name, t in before.items():
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            rows, cols = t.shape
            want = t.to(wide).reshape(G, 8 // G, rows // 8, cols).mean(dim=1).reshape(-1, cols).to(dtype)
            pooled += 1
        else:
            want = t
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert torch.equal(got[name].view(torch.uint8), want.contiguous().view(torch.uint8)), name
    assert pooled == 2 * 2  # K and V of both layers


def test_the_convert_command_leaves_its_objects_to_the_os_at_exit(tiny_model, tmp_path, monkeypatch):
    """`gqakit convert` registers `gc.freeze` at exit once per process, so the interpreter's last
    collections skip the objects torch's import made."""
    import gc
    from types import SimpleNamespace

    from gqakit.cli import main
    from gqakit.convert import cli as convert_cli

    registered: list = []
    monkeypatch.setattr(convert_cli, "_exit_collections_skipped", False)
    monkeypatch.setattr(convert_cli, "atexit", SimpleNamespace(register=registered.append))
    src = tiny_model("llama", num_key_value_heads=8)
    main(["convert", str(src), str(tmp_path / "a"), "-g", "2", "-q"])
    main(["convert", str(src), str(tmp_path / "b"), "-g", "2", "-q"])
    assert registered == [gc.freeze]


def test_a_convert_process_exits_with_its_objects_frozen(tmp_path):
    """In a real process: an exit handler registered before the command runs after gqakit's
    (atexit is last in, first out) and sees the objects frozen, on the error path too."""
    import subprocess
    import sys

    code = ("import atexit, gc\n"
            "atexit.register(lambda: print('frozen', gc.get_freeze_count() > 0))\n"
            "from gqakit.cli import main\n"
            f"main(['convert', {str(tmp_path / 'missing')!r}, {str(tmp_path / 'out')!r}, '-g', '1'])\n")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert got.returncode == 2 and "source not found" in got.stderr
    assert got.stdout.strip() == "frozen True"
