"""A GPT-style causal language model (the nanoGPT architecture), readable in one sitting.

Token + position embeddings, pre-LayerNorm transformer blocks with causal self-attention through
`scaled_dot_product_attention` (flash/memory-efficient kernels where the hardware has them), and the
output projection tied to the token embedding. Generation keeps each block's keys and values (KVCache), so that
each new token is one position's pass, not the whole context's.
"""

import math
from typing import Annotated, Literal, Optional

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from src.data.packing import documents_of
from src.schema.signature import Arg


class KVCache:
    """The keys and values of every token read so far, per block, and the document each token is in: generation
    reads the context once, then one new token per pass (GPT.generate, objective=grpo)."""

    def __init__(self):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.documents: Optional[torch.Tensor] = None  # (B, T) with position_ids: a new token's mask reads it

    def __len__(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Block `layer`'s keys and values of all tokens, the new ones (B, n_head, T_new, head_dim) added."""
        if layer == len(self.keys):
            self.keys.append(k)
            self.values.append(v)
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)
            self.values[layer] = torch.cat([self.values[layer], v], dim=2)
        return self.keys[layer], self.values[layer]


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        if n_embd % n_head != 0:
            raise ValueError(f"model.n_embd ({n_embd}) must be divisible by model.n_head ({n_head})")
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None,
                cache: Optional[tuple[KVCache, int]] = None) -> torch.Tensor:
        """`mask`: (B, 1, T, T_keys), True where a token may attend (packed documents); None: causal. `cache`: this
        block's place in a KVCache, whose keys and values come before x's (a new token then attends to them all)."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        reads_cache = cache is not None and cache[1] < len(cache[0].keys)  # this block has keys from before
        if cache is not None:
            k, v = cache[0].extend(cache[1], k, v)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
            is_causal=mask is None and not reads_cache,  # one new token after the cached ones attends to all
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float, bias: bool):
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None,
                cache: Optional[tuple[KVCache, int]] = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask, cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    # The unit FSDP shards by (accelerate reads it, as transformers models declare theirs): one Block at a time.
    _no_split_modules = ["Block"]

    def __init__(
        self,
        vocab_size: Annotated[int, Arg("distinct token ids (config/model/gpt.yaml takes it from the data)", ge=1)],
        block_size: Annotated[int, Arg("context length in tokens", ge=1)] = 64,
        n_layer: Annotated[int, Arg("transformer blocks", ge=1)] = 4,
        n_head: Annotated[int, Arg("attention heads (must divide n_embd)", ge=1)] = 4,
        n_embd: Annotated[int, Arg("embedding width", ge=1)] = 128,
        dropout: Annotated[float, Arg("dropout probability", ge=0, lt=1)] = 0.0,
        bias: Annotated[bool, Arg("biases in Linear and LayerNorm layers")] = False,
        gradient_checkpointing: Annotated[bool, Arg("recompute each block's activations in the backward pass: "
                                                    "less memory, about a third more compute")] = False,
        head: Annotated[Literal["lm", "reward"], Arg(
            "lm: next-token logits (tied to the embedding); reward: one value per position, a reward model's "
            "(objective=reward reads it at each answer's last token)")] = "lm",
    ):
        super().__init__()
        self.block_size = block_size
        self.gradient_checkpointing = gradient_checkpointing
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.head = head
        self.lm_head = nn.Linear(n_embd, vocab_size if head == "lm" else 1, bias=False)
        # Weight tying (Press & Wolf, 2017): fewer parameters and a better LM at this scale.
        self.tie_weights()

        self.apply(self._init_weights)
        # GPT-2's scaled init of the residual projections keeps the residual stream's variance flat in depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def tie_weights(self) -> None:
        """Also what accelerate calls after it moves the model between devices (an FSDP sharded start)."""
        if self.head == "lm":  # a reward model's output layer is its own
            self.lm_head.weight = self.tok_emb.weight

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None, cache: Optional[KVCache] = None,
                logits_to_keep: int = 0) -> torch.Tensor:
        """Token ids (B, T) -> next-token logits (B, T, vocab_size); with head=reward, values (B, T, 1).

        `attention_mask` is accepted so that Hugging Face-style batches fit, and needs no use: with causal
        attention and padding on the right (as src/data/jsonl.py pads), no real token attends to a pad.
        `position_ids` (B, T), as packed documents come (src/data/packing.py): each document's tokens take their
        positions in it and attend to their own document only (a left pad is a document of its own).
        `cache` (generation): the tokens read before these, which it keeps; with it, either the whole context
        (an empty cache) or one new token per call. `logits_to_keep` (transformers' argument): n > 0 computes the
        output layer for the last n positions only, (B, n, vocab_size).
        """
        idx, T = input_ids, input_ids.shape[1]
        past = len(cache) if cache is not None else 0
        if past + T > self.block_size:
            raise ValueError(f"sequence length {past + T} exceeds model.block_size {self.block_size}")
        mask = None
        if position_ids is None:
            pos = torch.arange(past, past + T, device=idx.device)
        elif past:  # one new token: it continues the last token's document
            pos, new = position_ids, cache.documents[:, -1:]
            cache.documents = torch.cat([cache.documents, new], dim=1)
            mask = (cache.documents == new)[:, None, None, :]  # (B, 1, 1, past + 1)
        else:
            pos, documents = position_ids, documents_of(position_ids)
            causal = torch.ones(T, T, dtype=torch.bool, device=idx.device).tril()
            mask = (causal & (documents[:, :, None] == documents[:, None, :])).unsqueeze(1)  # (B, 1, T, T)
            if cache is not None:
                cache.documents = documents
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for layer, block in enumerate(self.blocks):
            if self.gradient_checkpointing and self.training:
                # The recomputation replays the block's RNG state, so dropout masks (and the loss) are unchanged.
                x = torch.utils.checkpoint.checkpoint(block, x, mask, use_reentrant=False)
            else:
                x = block(x, mask, None if cache is None else (cache, layer))
        x = self.ln_f(x)
        return self.lm_head(x[:, -logits_to_keep:] if logits_to_keep else x)

    def flops_per_token(self) -> int:
        """Training FLOPs per token (6N + attention), as in the PaLM paper's MFU appendix."""
        n_params = sum(p.numel() for p in self.parameters()) - self.pos_emb.weight.numel()
        n_layer, d = len(self.blocks), self.tok_emb.embedding_dim
        return 6 * n_params + 12 * n_layer * d * self.block_size

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: Optional[int] = None) -> torch.Tensor:
        """Sample max_new_tokens after the ids (B, T), each from the softmax of its logits / temperature,
        restricted to the top_k likeliest (as nanoGPT's sample.py does). Uses torch's global RNG. Each new token
        reads the cache while the context fits the block; past it, the last block_size tokens, as nanoGPT."""
        cache, new = KVCache(), idx
        for _ in range(max_new_tokens):
            if cache is not None and idx.shape[1] > self.block_size:
                cache = None  # the window slides: every position moves
            if cache is not None:
                logits = self(new, cache=cache)[:, -1, :] / temperature
            else:
                logits = self(idx[:, -self.block_size :])[:, -1, :] / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, -float("inf"))
            new = torch.multinomial(F.softmax(logits, dim=-1), 1)
            idx = torch.cat([idx, new], dim=1)
        return idx
