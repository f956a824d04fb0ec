"""How far the gradient of one training step moves when keys and values are reduced in cells, mean against
sampled (``cell_pool``), on the shipped trained UNet (the model ``examples/finetune_lora.py`` fine-tunes).

One fixed batch of 16 noisy crops (seeded noise and timesteps over the whole schedule), the training loss (MSE
to the noise), the gradient of every weight. For each cell set: the relative L2 distance to the unpatched
gradient of the mean-pooled step, of one sampled step (averaged over the draws), and of the average of the
first 4, 8, 16 and 32 draws (``seed`` 0-31 draw the tokens). If the distance of the average falls towards zero
as draws are added, sampling moves the gradient by noise that averages out over steps; the mean-pooled step's
distance is a fixed bias. Run: ``python docs/results/train_cell_gradients.py`` (torch; about a minute). Where
docs/results/train_cell_gradients.txt comes from."""

import torch
from diffusers import DDPMScheduler

from tome_tools.console import quiet_known_notices

quiet_known_notices()

import tome_core.torch as tome
from tome_tools import trained
from tome_tools import diffusers_trained

torch.set_num_threads(1)
CELLS = {
    "kv 2x2 cells (level 1)": dict(mode="kv", matching="cell"),
    "kv 4x4 + 2x2 cells (levels 1, 2)": dict(mode="kv", matching="cell", level_cells={1: 4, 2: 2}, max_downsample=2),
}
DRAWS = 32


def main() -> None:
    model = diffusers_trained.load(trained.shipped("trained-unet"))
    unet = model.model.train()
    images, labels = trained.crops(8, seed=1)
    clean, labels = torch.from_numpy(images[:16]), torch.from_numpy(labels[:16]).long()
    generator = torch.Generator().manual_seed(0)
    noise = torch.randn(clean.shape, generator=generator)
    timesteps = torch.randint(0, 1000, (len(clean),), generator=generator)
    noisy = DDPMScheduler.from_config(model.scheduler_config).add_noise(clean, noise, timesteps)
    condition = model.condition(labels)

    def gradient(options):
        if options:
            tome.patch(unet, **options)
        unet.zero_grad(set_to_none=True)
        prediction = diffusers_trained.call_model(unet, noisy, timesteps, condition)
        torch.nn.functional.mse_loss(prediction, noise).backward()
        if options:
            tome.remove(unet)
        return torch.cat([p.grad.flatten() for p in unet.parameters() if p.grad is not None])

    unpatched = gradient(None)
    distance = lambda g: float((g - unpatched).norm() / unpatched.norm())
    print(f"relative L2 distance of the gradient of every weight to the unpatched step's (trained-unet, batch {len(clean)})")
    print(f"{'cells':34} {'mean':>7} {'one draw':>9} " + " ".join(f"{'avg ' + str(k):>7}" for k in (4, 8, 16, 32)))
    for name, options in CELLS.items():
        draws = [gradient({**options, "cell_pool": "sample", "seed": seed}) for seed in range(DRAWS)]
        averages = [distance(torch.stack(draws[:k]).mean(0)) for k in (4, 8, 16, 32)]
        one = sum(distance(d) for d in draws) / DRAWS
        print(f"{name:34} {distance(gradient(options)):7.4f} {one:9.4f} " + " ".join(f"{a:7.4f}" for a in averages))


if __name__ == "__main__":
    main()
