"""A GAN with two engines: the generator's loss flows through the discriminator's engine.

DeepSpeed's DCGAN example pattern: the discriminator's parameters receive gradients during the
generator's ``engine.backward``; they accumulate there until the discriminator's next
``zero_grad`` (here ``netD.zero_grad()``, as the example does). Weights must match a plain
single-process PyTorch loop at every stage.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerotrain.testing import run_on_ranks

STEPS, BATCH, LR = 3, 4, 0.1


def _nets():
    torch.manual_seed(0)
    netG = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8))
    netD = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    return netG, netD


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, BATCH, 8, generator=g), torch.randn(STEPS, BATCH, 4, generator=g)


def _iteration(netG, netD, real, noise, backward_D, step_D, backward_G, step_G):
    bce = nn.BCEWithLogitsLoss()
    netD.zero_grad()
    errD_real = bce(netD(real), torch.ones(len(real), 1))
    backward_D(errD_real)
    fake = netG(noise)
    errD_fake = bce(netD(fake.detach()), torch.zeros(len(real), 1))
    backward_D(errD_fake)
    step_D()
    netG.zero_grad()
    errG = bce(netD(fake), torch.ones(len(real), 1))
    backward_G(errG)
    step_G()


def _engines(stage: int) -> dict:
    import torch.distributed as dist

    import zerotrain

    zerotrain.init_distributed()
    netG, netD = _nets()
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH // 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engineG, *_ = zerotrain.initialize(model=netG, config=cfg)
    engineD, *_ = zerotrain.initialize(model=netD, config=cfg)
    rank = dist.get_rank()
    reals, noises = _data()
    for real, noise in zip(reals, noises):
        rows = slice(2 * rank, 2 * rank + 2)
        _iteration(
            engineG, engineD, real[rows], noise[rows], engineD.backward, engineD.step, engineG.backward, engineG.step
        )
    out = {"G": engineG.module_state_dict(), "D": engineD.module_state_dict()}
    engineG.destroy()
    engineD.destroy()
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_generator_loss_through_discriminator_engine(stage):
    netG, netD = _nets()
    optG = torch.optim.SGD(netG.parameters(), lr=LR)
    optD = torch.optim.SGD(netD.parameters(), lr=LR)
    reals, noises = _data()
    for real, noise in zip(reals, noises):
        _iteration(
            netG, netD, real, noise, lambda loss: loss.backward(), optD.step, lambda loss: loss.backward(), optG.step
        )
    got = run_on_ranks(_engines, 2, args=(stage,))[0]
    for name, net in (("G", netG), ("D", netD)):
        for key, want in net.state_dict().items():
            err = float((got[name][key] - want).norm() / want.norm())
            assert err <= 1e-5, (stage, name, key, err)
