"""``MNIST(root, train, download, transform)``: 256 synthetic MNIST-shaped samples."""

import torch


class MNIST(torch.utils.data.Dataset):
    def __init__(self, root=None, train=True, download=False, transform=None):
        g = torch.Generator().manual_seed(0 if train else 1)
        self.images = torch.rand(256, 1, 28, 28, generator=g)
        self.labels = torch.randint(0, 10, (256,), generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], int(self.labels[i])
