"""An offline stand-in for the two torchvision names TorchAcc's pipeline script uses
(``datasets.MNIST`` and ``transforms.ToTensor``): MNIST-shaped synthetic data (1x28x28 images,
labels 0-9), the same on every process, so the unchanged script runs without a download. Only
on the test's PYTHONPATH (tests/test_pipeline.py)."""

from torchvision import datasets, transforms  # noqa: F401
