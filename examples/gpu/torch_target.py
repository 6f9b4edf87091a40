"""The target (a Llama with tied embeddings: SmolLM2) in PyTorch, for the
device, which has no MLX: the forward with the drafter's taps, and batched
KV-cache generation of left-padded prompts.

The residual stream, norms, taps and logits are float32, as the target runs
on the Mac; ``tests/test_gpu_route.py`` checks taps, logits and greedy
tokens against mlx-lm on CPU.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


class KVCache:
    """Preallocated keys/values ``[B, Hkv, max_len, hd]`` per layer; ``valid``
    marks the columns that hold a real (not padding) token."""

    def __init__(self, layers: int, shape: tuple[int, int, int, int], device):
        self.k = [torch.zeros(shape, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, device=device) for _ in range(layers)]
        self.valid = torch.zeros(shape[0], shape[2], dtype=torch.bool, device=device)
        self.offset = 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class Target(torch.nn.Module):
    def __init__(
        self,
        weights: dict[str, np.ndarray],
        config: dict,
        layer_ids: tuple[int, ...],
        device: str = "cpu",
    ):
        super().__init__()
        self.hidden_size = config["hidden_size"]
        self.n_heads = config["num_attention_heads"]
        self.n_kv = config["num_key_value_heads"]
        self.head_dim = config.get("head_dim") or self.hidden_size // self.n_heads
        self.eps = config["rms_norm_eps"]
        self.layer_ids = tuple(layer_ids)
        if config.get("rope_traditional") or not config.get(
            "tie_word_embeddings", True
        ):
            raise ValueError("only Llama targets with tied embeddings and HF RoPE")

        def tensor(name: str) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(weights[name])).to(device)

        self.embed = tensor("model.embed_tokens.weight")
        self.norm = tensor("model.norm.weight")
        self.layers = []
        for i in range(config["num_hidden_layers"]):
            p = f"model.layers.{i}."
            attn = [tensor(f"{p}self_attn.{n}_proj.weight") for n in "qkv"]
            mlp = [tensor(f"{p}mlp.{n}_proj.weight") for n in ("gate", "up")]
            self.layers.append(
                {
                    "ln1": tensor(p + "input_layernorm.weight"),
                    "ln2": tensor(p + "post_attention_layernorm.weight"),
                    "qkv": torch.cat(attn),
                    "o": tensor(p + "self_attn.o_proj.weight"),
                    "gate_up": torch.cat(mlp),
                    "down": tensor(p + "mlp.down_proj.weight"),
                }
            )
        half = torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim
        self.inv_freq = (1.0 / config.get("rope_theta", 10000.0) ** half).to(device)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def make_cache(self, batch: int, length: int) -> KVCache:
        shape = (batch, self.n_kv, length, self.head_dim)
        return KVCache(len(self.layers), shape, self.device)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.embed)

    def _rope(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        half = self.head_dim // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        real: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Final normed hidden states ``[B, L, d]`` and the taps ``[B, L,
        len(layer_ids) * d]`` (layer outputs, concatenated). ``real`` is False
        at padding, whose keys no other token attends to; ``positions``
        default to the cache offset onwards."""
        B, L = tokens.shape
        start = cache.offset if cache is not None else 0
        end = start + L
        device = tokens.device
        if positions is None:
            positions = (start + torch.arange(L, device=device)).expand(B, L)
        if real is None:
            real = torch.ones(B, L, dtype=torch.bool, device=device)
        if cache is not None:
            cache.valid[:, start:end] = real
            real = cache.valid[:, :end]
        queries = torch.arange(start, end, device=device)[:, None]
        keys = torch.arange(end, device=device)[None, :]
        mask = (real[:, None, :] & (keys <= queries)) | (keys == queries)
        mask = mask[:, None]
        angles = positions.float()[..., None] * self.inv_freq
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]
        H, Hkv, hd = self.n_heads, self.n_kv, self.head_dim
        h = F.embedding(tokens, self.embed)
        taps = []
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, layer["ln1"], self.eps)
            q, k, v = F.linear(x, layer["qkv"]).split([H * hd, Hkv * hd, Hkv * hd], -1)
            q = self._rope(q.view(B, L, H, hd).transpose(1, 2), cos, sin)
            k = self._rope(k.view(B, L, Hkv, hd).transpose(1, 2), cos, sin)
            v = v.view(B, L, Hkv, hd).transpose(1, 2)
            if cache is not None:
                cache.k[i][:, :, start:end] = k
                cache.v[i][:, :, start:end] = v
                k, v = cache.k[i][:, :, :end], cache.v[i][:, :, :end]
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            h = h + F.linear(a.transpose(1, 2).reshape(B, L, H * hd), layer["o"])
            x = rms_norm(h, layer["ln2"], self.eps)
            gate, up = F.linear(x, layer["gate_up"]).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer["down"])
            if i in self.layer_ids:
                taps.append(h)
        if cache is not None:
            cache.offset = end
        return rms_norm(h, self.norm, self.eps), torch.cat(taps, dim=-1)


@torch.no_grad()
def generate(
    target: Target,
    prompts: list[list[int]],
    max_tokens: int,
    temperature: float,
    stop: set[int],
    batch_size: int,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """Each prompt's continuation (greedy at temperature 0, else sampled),
    ending after its first ``stop`` token or at ``max_tokens``. Prompts go in
    batches of similar lengths, left padded; answers return in input order."""
    device = target.device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    answers: list[list[int]] = [[] for _ in prompts]
    stop_ids = torch.tensor(sorted(stop) or [-1], device=device)
    for first in range(0, len(order), batch_size):
        rows = order[first : first + batch_size]
        width = max(len(prompts[i]) for i in rows)
        tokens = torch.zeros(len(rows), width, dtype=torch.long)
        real = torch.zeros(len(rows), width, dtype=torch.bool)
        for r, i in enumerate(rows):
            n = len(prompts[i])
            tokens[r, width - n :] = torch.tensor(prompts[i])
            real[r, width - n :] = True
        tokens, real = tokens.to(device), real.to(device)
        positions = (real.cumsum(1) - 1).clamp(min=0)
        lengths = real.sum(1)
        cache = target.make_cache(len(rows), width + max_tokens)
        hidden, _ = target(tokens, positions, real, cache)
        out = []
        finished = torch.zeros(len(rows), dtype=torch.bool, device=device)
        for step in range(max_tokens):
            logits = target.logits(hidden[:, -1])
            if temperature == 0:
                token = logits.argmax(-1)
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                token = torch.multinomial(probs, 1, generator=generator)[:, 0]
            out.append(token)
            finished |= torch.isin(token, stop_ids)
            if step + 1 == max_tokens or bool(finished.all()):
                break
            hidden, _ = target(token[:, None], (lengths + step)[:, None], None, cache)
        for r, row in enumerate(torch.stack(out, 1).tolist()):
            ends = [j for j, t in enumerate(row) if t in stop]
            answers[rows[r]] = row[: ends[0] + 1] if ends else row
    return answers
