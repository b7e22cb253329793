"""CUDA checks of the 2026-11-26 (sixth session) changes; run by check.sh after the tests."""

import math

import torch
from torch import nn

import semipack
from semipack.kernels.logspace import log_magnitude_plus_

dev = "cuda"
torch.manual_seed(0)
x = (torch.randn(300, 128, device=dev) * 10).exp()
x[:, ::5] = 0.0
x[0, 0] = float("nan")
shift = torch.tensor(2.5, device=dev)
want = x.clone().log_().add_(shift)
got = log_magnitude_plus_(x.clone(), shift)
same = all(torch.equal(f(got), f(want)) for f in (torch.isnan, torch.isneginf, torch.isposinf))
fin = torch.isfinite(want)
print(
    "log_magnitude_plus_ cuda: same inf/nan",
    same,
    "max abs diff",
    (got - want)[fin].abs().max().item(),
)

lin = nn.Linear(3, 2).to(dev)
xx = torch.tensor([[1.0, 1e-9, 2.0]], device=dev)
vals = []
for ext in (True, False):
    lin.zero_grad(set_to_none=True)
    with semipack.extend(lin, semipack.MaxProd(), extensions=ext):
        with torch.autocast("cuda", dtype=torch.float16):
            out = lin(xx)
        out.float().sum().backward()
    vals.append(lin.weight.semiring_grad.clone())
print("autocast cuda: ext == generic", torch.equal(*vals), "cut column", vals[0][:, 1].tolist())


class Block(nn.Module):
    def __init__(self, c=160):
        super().__init__()
        self.a, self.b, self.c = (nn.Conv2d(c, c, 1) for _ in range(3))
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        h = self.bn(self.a(x))
        return self.c(h + self.b(h))


m = Block().eval().to(dev).to(memory_format=torch.channels_last)
xb = torch.randn(2, 160, 1, 1, device=dev).contiguous(memory_format=torch.channels_last)
m(xb).pow(2).sum().backward()
plain = {n: p.grad.clone() for n, p in m.named_parameters()}
m.zero_grad(set_to_none=True)
with semipack.extend(m, semipack.MaxProd()):
    m(xb).pow(2).sum().backward()
print(
    "channels_last 1x1 cuda: .grad bitwise",
    all(torch.equal(p.grad, plain[n]) for n, p in m.named_parameters()),
)

mlp = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 8)).to(dev)
xi = torch.randn(32, 64, device=dev)
for sr in (semipack.MaxProd(), semipack.Entropy(), semipack.LogSum()):
    with semipack.extend(mlp, sr):
        mlp(xi).sum().backward()
        first = [p.semiring_grad.data_ptr() for p in mlp.parameters()]
        mlp(xi).sum().backward()
    ok = all(
        math.isfinite(float(p.semiring_grad.float().nan_to_num(0).sum())) for p in mlp.parameters()
    )
    print(
        sr,
        "second pass finite",
        ok,
        "reused",
        [p.semiring_grad.data_ptr() for p in mlp.parameters()] == first,
    )
