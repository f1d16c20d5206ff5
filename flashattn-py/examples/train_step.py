"""A model written against flash-attn, trained one step on the CPU with flashattn in its place.

    python flashattn-py/examples/train_step.py

The model below imports `flash_attn_func` as flash-attn users do; the two lines under "the swap"
are all it takes to run it on flashattn (on a machine without flash-attn).
"""

import torch
import torch.nn as nn

# --- the swap: `import flash_attn` now resolves to flashattn ---
import flashattn.compat
flashattn.compat.install()

from flash_attn import flash_attn_func  # noqa: E402  (the model's own import, unchanged)


class Block(nn.Module):
    def __init__(self, dim=128, heads=4):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.norm, self.mlp = nn.LayerNorm(dim), nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(),
                                                              nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, n, dim = x.shape
        qkv = self.qkv(self.norm(x)).view(b, n, 3, self.heads, dim // self.heads)
        att = flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)
        x = x + self.proj(att.reshape(b, n, dim))
        return x + self.mlp(x)


def main():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(256, 128), Block(), Block(), nn.Linear(128, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (4, 129))
    losses = []
    for _ in range(3):
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print("losses:", " ".join(f"{x:.4f}" for x in losses))
    return losses


if __name__ == "__main__":
    main()
