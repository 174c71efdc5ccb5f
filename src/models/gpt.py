"""A GPT-style causal language model (the nanoGPT architecture), readable in one sitting.

Token + position embeddings, pre-LayerNorm transformer blocks with causal self-attention through
`scaled_dot_product_attention` (flash/memory-efficient kernels where the hardware has them), and the
output projection tied to the token embedding.
"""

import math
from typing import Annotated, Literal, Optional

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from src.data.packing import documents_of
from src.schema.signature import Arg


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

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`mask`: (B, 1, T, T), True where a token may attend (packed documents); None: causal."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0, is_causal=mask is None
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

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask)
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
                position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Token ids (B, T) -> next-token logits (B, T, vocab_size); with head=reward, values (B, T, 1).

        `attention_mask` is accepted so that Hugging Face-style batches fit, and needs no use: with causal
        attention and padding on the right (as src/data/jsonl.py pads), no real token attends to a pad.
        `position_ids` (B, T), as packed documents come (src/data/packing.py): each document's tokens take their
        positions in it and attend to their own document only.
        """
        idx, T = input_ids, input_ids.shape[1]
        if T > self.block_size:
            raise ValueError(f"sequence length {T} exceeds model.block_size {self.block_size}")
        mask = None
        if position_ids is None:
            pos = torch.arange(T, device=idx.device)
        else:
            pos, documents = position_ids, documents_of(position_ids)
            causal = torch.ones(T, T, dtype=torch.bool, device=idx.device).tril()
            mask = (causal & (documents[:, :, None] == documents[:, None, :])).unsqueeze(1)  # (B, 1, T, T)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            if self.gradient_checkpointing and self.training:
                # The recomputation replays the block's RNG state, so dropout masks (and the loss) are unchanged.
                x = torch.utils.checkpoint.checkpoint(block, x, mask, use_reentrant=False)
            else:
                x = block(x, mask)
        return self.lm_head(self.ln_f(x))

    def flops_per_token(self) -> int:
        """Training FLOPs per token (6N + attention), as in the PaLM paper's MFU appendix."""
        n_params = sum(p.numel() for p in self.parameters()) - self.pos_emb.weight.numel()
        n_layer, d = len(self.blocks), self.tok_emb.embedding_dim
        return 6 * n_params + 12 * n_layer * d * self.block_size

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: Optional[int] = None) -> torch.Tensor:
        """Sample max_new_tokens after the ids (B, T), each from the softmax of its logits / temperature,
        restricted to the top_k likeliest (as nanoGPT's sample.py does). Uses torch's global RNG."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.block_size :])[:, -1, :] / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, -float("inf"))
            idx = torch.cat([idx, torch.multinomial(F.softmax(logits, dim=-1), 1)], dim=1)
        return idx
