"""bf16 Linear layers of the families the native forward pass does not implement run in the C
matrix kernel, reading the stored weights, and their lookup-only tables stay bf16: the same
logits as MLX's float32 layers
(REWIND_NATIVE=off), on the engine's thread, batched and through the prompt cache."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from rewind.cache import PromptCache
from rewind.config import CacheConfig, EngineConfig
from rewind.engine import Engine, GenerationRequest, SamplingParams
from rewind.kernels import native
from rewind.kernels.native_linear import NativeLinear, native_linear_bytes
from rewind.kernels.stored_embedding import StoredEmbedding
from rewind.models.conversion import QuantSpec, convert
from rewind.models.loader import describe_compute, load_model
from rewind.testing.tiny_models import build_tiny_model

pytestmark = [pytest.mark.cpu_only, pytest.mark.skipif(
    native.load_kernels() is None, reason="needs x86-64 AVX2 and a C compiler")]

TEXT = ("An agent reads a long conversation again and again, and each turn adds a tool result. "
        "def fibonacci(n: int) -> int:\n    a, b = 0, 1\n    return a\n") * 6


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory: pytest.TempPathFactory):
    """bf16 conversions of tiny models of families without a native forward pass."""
    folders: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in folders:
            root = tmp_path_factory.mktemp(f"bf16-{family}")
            built = build_tiny_model(family, root / "f32")
            folders[family] = convert(built, root / "bf16", QuantSpec(16), show_progress=False)
        return folders[family]

    return get


def logits_trace(model, prompt: list[int]) -> np.ndarray:
    """Every position's logits, prefilled in uneven chunks, then three decode steps."""
    cache = make_prompt_cache(model)
    rows = [np.array(model(mx.array([prompt[a:b]]), cache=cache)[0])
            for a, b in ((0, 37), (37, 200), (200, len(prompt)))]
    rows += [np.array(model(mx.array([[token]]), cache=cache)[0]) for token in (5, 17, 99)]
    return np.concatenate(rows)


@pytest.mark.parametrize("family", ["qwen3_5", "gemma4"])
def test_logits_equal_mlx_float32_layers(bf16_folder, family: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    folder = bf16_folder(family)
    fast = load_model(str(folder))
    linears = [m for _, m in fast.model.named_modules() if isinstance(m, NativeLinear)]
    assert linears and native_linear_bytes(fast.model) > 0
    assert "bf16 Linear layers in C kernels" in describe_compute(fast.model)
    assert native_linear_bytes(load_model(str(folder), native_forward="off").model) == 0
    if family == "gemma4":  # its per-layer input table is looked up, never a head
        tables = [m for _, m in fast.model.named_modules() if isinstance(m, StoredEmbedding)]
        assert len(tables) == 1 and tables[0]._table.dtype == mx.bfloat16
    monkeypatch.setenv("REWIND_NATIVE", "off")
    plain = load_model(str(folder))
    assert native_linear_bytes(plain.model) == 0
    prompt = np.random.default_rng(7).integers(3, 400, 260).tolist()
    expected = logits_trace(plain.model, prompt)
    got = logits_trace(fast.model, prompt)
    assert np.abs(got - expected).max() < 1e-4 * max(1.0, np.abs(expected).max())


def test_engine_and_prompt_cache_give_plain_greedy(bf16_folder, tmp_path: Path) -> None:
    """The hybrid in bf16 through the kernels: batched, and restored from the prompt cache,
    the engine gives the tokens of plain batch-1 greedy decoding."""
    loaded = load_model(str(bf16_folder("qwen3_5")))
    model, tokenizer = loaded.model, loaded.tokenizer
    turn1 = tokenizer.encode(TEXT)

    def greedy(prompt: list[int], steps: int) -> list[int]:
        cache = make_prompt_cache(model)
        logits = model(mx.array([prompt]), cache=cache)[:, -1, :]
        out: list[int] = []
        while len(out) < steps:
            out.append(int(mx.argmax(logits, axis=-1).item()))
            logits = model(mx.array([[out[-1]]]), cache=cache)[:, -1, :]
        return out

    bias = {int(t): -1e9 for t in Engine(loaded).eos_token_ids}
    params = SamplingParams(temperature=0.0, max_tokens=8, logit_bias=bias)
    prompt_cache = PromptCache(model, loaded.fingerprint,
                               CacheConfig(cache_dir=tmp_path, disk_bytes=64 << 20))
    try:
        with Engine(loaded, EngineConfig(parallel=2), prompt_cache) as engine:
            first, other = (engine.submit(GenerationRequest(p, params))
                            for p in (turn1, tokenizer.encode("The quick brown fox " * 4)))
            first, other = first.collect(120), other.collect(120)
            turn2 = turn1 + first.tokens + tokenizer.encode(" and one more",
                                                            add_special_tokens=False)
            second = engine.generate(GenerationRequest(turn2, params), 120)
    finally:
        prompt_cache.close()
    assert first.tokens == greedy(turn1, 8)
    assert other.tokens == greedy(tokenizer.encode("The quick brown fox " * 4), 8)
    assert second.finish.usage.cached_tokens == len(turn1) + len(first.tokens) - 1
    assert second.tokens == greedy(turn2, 8)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("lead", [(1,), (37,), (2, 5)])
def test_a_linear_layer_equals_the_float32_product(bias: bool, lead: tuple) -> None:
    """x @ W^T (+ b) for a bf16 layer, any leading shape, with and without a bias (Qwen 2's q,
    k and v have one), against the same product in float32."""
    mx.random.seed(len(lead) * 10 + bias)
    layer = nn.Linear(72, 40, bias=bias)
    layer.set_dtype(mx.bfloat16)
    x = mx.random.normal((*lead, 72))
    expected = x @ layer.weight.astype(mx.float32).T
    if bias:
        expected = expected + layer.bias.astype(mx.float32)
    got = NativeLinear(layer)(x)
    assert got.shape == (*lead, 40) and got.dtype == mx.float32
    assert float(mx.abs(got - expected).max()) < 1e-4


def test_after_the_native_forward_pass_is_removed(tmp_path: Path) -> None:
    """rewind.vision.mrope moves a loaded llama-family model (the C layer kernels installed,
    its Linear weights slices of stacked bf16 matrices) to MLX's layers: the Linear layers then
    read those slices, and the logits are MLX's float32 ones."""
    from rewind.kernels.native_forward import native_forward
    from rewind.models.loader import use_mlx_layers

    folder = convert(build_tiny_model("llama", tmp_path / "f32"), tmp_path / "bf16",
                     QuantSpec(16), show_progress=False)
    moved = load_model(str(folder))
    assert native_forward(moved.model) is not None
    use_mlx_layers(moved.model)
    assert native_forward(moved.model) is None and native_linear_bytes(moved.model) > 0
    plain = load_model(str(folder), native_forward="off")
    tokens = mx.array([list(range(3, 200))])
    expected = np.array(plain.model(tokens))
    got = np.array(moved.model(tokens))
    assert np.abs(got - expected).max() < 1e-4 * max(1.0, np.abs(expected).max())


@pytest.mark.parametrize("form", ["f32", "bf16", "int8"])
def test_a_rows_bits_do_not_depend_on_the_thread_count(form: str) -> None:
    """The dense matrix kernel sizes its claims by the thread count for a few activation rows
    (decode; cpu_kernels.c's matvec_claim_rows) and takes 64-row claims for more: a row's sums
    run in blocks of four output rows, so a claim that split a block would change its bits.
    4,098 rows: claims of more than 64 rows at 1 to 5 threads, the last block part-filled."""
    from rewind.kernels import boundary
    from rewind.kernels.boundary import MatrixArgs

    rng = np.random.default_rng(29)
    weight = rng.standard_normal((4098, 72)).astype(np.float32)
    scale = None
    if form == "bf16":
        weight = np.asarray(mx.array(weight).astype(mx.bfloat16).view(mx.uint16))
    elif form == "int8":
        weight = rng.integers(-127, 128, size=weight.shape, dtype=np.int8)
        scale = rng.uniform(0.001, 0.01, size=4098).astype(np.float32)
    matrix = MatrixArgs.build(weight, native.FORMS[form], scale)
    kernels = boundary.kernels_for(native.chosen_isa())
    x = rng.standard_normal((9, 72)).astype(np.float32)

    def product(rows: np.ndarray, threads: int) -> np.ndarray:
        out = np.zeros((rows.shape[0], 4098), np.float32)
        kernels.matvec(matrix, rows, out, threads)
        return out

    together = product(x, 2)
    for threads in (1, 2, 3, 5):
        for m in (1, 2, 4):
            np.testing.assert_array_equal(product(x[:m], threads), together[:m],
                                          err_msg=f"{form}, {m} rows on {threads} threads")
