"""What a lossy cache costs in accuracy: its logits against the exact cache's, teacher-forced.

The exact reference is `contiguous` with K/V stored in the compute dtype. Both caches are fed the same tokens (the
reference's own greedy continuation, or a real text), so one early divergence cannot compound into every later
step: each step compares next-token distributions given the same history.

With dummy weights attention is nearly uniform and logits nearly flat, so these figures bound the numerical error
of the format rather than predict a real model's quality loss: use a real checkpoint (`weights=DIR`, and
`eval_text=FILE` for perplexity) for that.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from harness.kv.base import KVCache
from harness.modeling.decode import decode_logits, prefill_logits


@torch.inference_mode()
def teacher_forced_logits(model: torch.nn.Module, cache: KVCache, prompt: torch.Tensor, forced: torch.Tensor):
    """Logits [B, N, V] (fp32) predicting forced[:, 0..N-1]: prefill the prompt, then feed forced tokens one by one.

    prompt [B, P]; forced [B, N]. Logits i is the model's distribution for position P + i given the prompt and
    forced[:, :i], read through `cache`.
    """
    steps = [prefill_logits(model, cache, prompt).float()]
    tokens = torch.cat([prompt, forced], dim=1)
    prompt_len = prompt.shape[1]
    for pos in range(prompt_len, prompt_len + forced.shape[1] - 1):
        steps.append(decode_logits(model, cache, tokens, pos).float())
    cache.release()
    return torch.stack(steps, dim=1)


def kl_per_step(exact: torch.Tensor, lossy: torch.Tensor) -> torch.Tensor:
    """KL(exact || lossy) in nats of the next-token distributions of two [..., V] logit (or log-probability)
    tensors -> [...]: the one definition the sweep's kl_mean and serving's accuracy_kl_* (harness.serve.accuracy)
    share."""
    log_p = F.log_softmax(exact, dim=-1)
    log_q = F.log_softmax(lossy, dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)


def compare(exact: torch.Tensor, lossy: torch.Tensor) -> dict:
    """The accuracy columns from two [B, N, V] logit tensors."""
    kl = kl_per_step(exact, lossy)  # [B, N]: KL(exact || lossy) per step, nats
    return {
        "logit_max_abs_err": (exact - lossy).abs().max().item(),
        "kl_mean": kl.mean().clamp_min(0.0).item(),
        "top1_agreement": (exact.argmax(dim=-1) == lossy.argmax(dim=-1)).float().mean().item(),
    }


def perplexity(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """exp(mean next-token NLL); logits [B, N, V] predict targets [B, N]."""
    nll = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="mean")
    return math.exp(nll.item())


def text_windows(path: str | Path, checkpoint: str | Path, *, batch_size: int, length: int) -> torch.Tensor:
    """[batch_size, length] token ids: consecutive windows of a local text file, with the checkpoint's tokenizer.

    Reads tokenizer.json with the `tokenizers` library (a dependency of transformers; no network).
    """
    tokenizer_file = Path(checkpoint) / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ValueError(f"eval_text: perplexity needs {tokenizer_file}; allowed: a checkpoint with tokenizer.json")
    from tokenizers import Tokenizer  # imported here: only perplexity runs need it

    ids = Tokenizer.from_file(str(tokenizer_file)).encode(Path(path).read_text()).ids
    if len(ids) < batch_size * length:
        raise ValueError(
            f"eval_text: {path} has {len(ids)} tokens, fewer than batch_size x (prompt_len + gen_len) = "
            f"{batch_size * length}; allowed: a longer text or a smaller point"
        )
    return torch.tensor(ids[: batch_size * length]).view(batch_size, length)
