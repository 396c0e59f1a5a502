"""A torchvision-style image classification script: a small ResNet, a Dataset whose transforms are
nn.Modules (as torchvision's are), a DataLoader with worker processes, SGD with momentum.

Laid out like torchvision's references/classification/train.py, shortened; torchvision itself is not
needed (the transforms and the ResNet blocks are written here). Small by default so it runs on a CPU:

    python vision_train.py --dtype bfloat16 --max-steps 3
    python vision_train.py --bug pool-swap

--bug injects a real bug into the model or the data pipeline (see BUGS).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

BUGS = {
    "none": "no bug",
    "bn-eps": "the stem's BatchNorm built with eps=1e-3 instead of 1e-5",
    "pool-swap": "the stem's 3x3 max-pool replaced by an average pool",
    "relu6": "layer1.0 activates with ReLU6 instead of ReLU",
    "norm-bf16": "the Normalize transform computes in bfloat16 (in the DataLoader workers)",
}

# -----------------------------------------------------------------------------
# transforms: nn.Modules, like torchvision.transforms


class ToDtype(nn.Module):
    """uint8 image -> float in [0, 1] (torchvision's ConvertImageDtype)."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.dtype = dtype

    def forward(self, img):
        return img.to(self.dtype) / 255.0


class RandomHorizontalFlip(nn.Module):
    def __init__(self, p=0.5):
        super().__init__()
        self.p = p

    def forward(self, img):
        if torch.rand(1) < self.p:
            return img.flip(-1)
        return img


class RandomCrop(nn.Module):
    def __init__(self, size, padding):
        super().__init__()
        self.size = size
        self.padding = padding

    def forward(self, img):
        img = nn.functional.pad(img, [self.padding] * 4)
        h, w = img.shape[-2:]
        i = int(torch.randint(0, h - self.size + 1, (1,)))
        j = int(torch.randint(0, w - self.size + 1, (1,)))
        return img[..., i : i + self.size, j : j + self.size]


class Normalize(nn.Module):
    def __init__(self, mean, std, low_precision=False):
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean).view(-1, 1, 1))
        self.register_buffer("std", torch.tensor(std).view(-1, 1, 1))
        self.low_precision = low_precision

    def forward(self, tensor):
        if self.low_precision:  # halves the memory of the batch in flight
            return ((tensor.bfloat16() - self.mean.bfloat16()) / self.std.bfloat16()).float()
        return (tensor - self.mean) / self.std


# -----------------------------------------------------------------------------
# data


class SyntheticImages(Dataset):
    """Class-dependent blobs plus noise, as uint8 CHW images: a fixed set, the same on every run."""

    def __init__(self, num_samples, num_classes, image_size, seed, transform=None):
        g = torch.Generator().manual_seed(seed)
        self.targets = torch.randint(0, num_classes, (num_samples,), generator=g)
        prototypes = torch.rand(num_classes, 3, image_size, image_size, generator=g)
        noise = torch.rand(num_samples, 3, image_size, image_size, generator=g)
        images = 0.6 * prototypes[self.targets] + 0.4 * noise
        self.images = (images * 255).round().to(torch.uint8)
        self.transform = transform

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index):
        img, target = self.images[index], int(self.targets[index])
        if self.transform is not None:
            img = self.transform(img)
        return img, target


# -----------------------------------------------------------------------------
# model: a ResNet with torchvision's module names (conv1, bn1, relu, maxpool, layer1.0.conv1, ..., fc)


def conv3x3(in_planes, out_planes, stride=1):
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None, activation=nn.ReLU):
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = activation(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x):
        identity = x

        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)

        out = self.conv2(out)
        out = self.bn2(out)

        if self.downsample is not None:
            identity = self.downsample(x)

        out += identity
        out = self.relu(out)

        return out


class ResNet(nn.Module):
    def __init__(self, layers=(1, 1, 1), widths=(16, 32, 64), num_classes=10, bug="none"):
        super().__init__()
        self.inplanes = widths[0]
        self.conv1 = nn.Conv2d(3, self.inplanes, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(self.inplanes, eps=1e-3 if bug == "bn-eps" else 1e-5)
        self.relu = nn.ReLU(inplace=True)
        if bug == "pool-swap":
            self.maxpool = nn.AvgPool2d(kernel_size=3, stride=2, padding=1)
        else:
            self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        stages = []
        for i, (blocks, width) in enumerate(zip(layers, widths)):
            activation = nn.ReLU6 if (bug == "relu6" and i == 0) else nn.ReLU
            stages.append(self._make_layer(width, blocks, stride=1 if i == 0 else 2, activation=activation))
        self.layer1, self.layer2, self.layer3 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(widths[-1] * BasicBlock.expansion, num_classes)

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, planes, blocks, stride=1, activation=nn.ReLU):
        downsample = None
        if stride != 1 or self.inplanes != planes * BasicBlock.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * BasicBlock.expansion, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(planes * BasicBlock.expansion),
            )
        layers = [BasicBlock(self.inplanes, planes, stride, downsample, activation=activation)]
        self.inplanes = planes * BasicBlock.expansion
        for _ in range(1, blocks):
            layers.append(BasicBlock(self.inplanes, planes, activation=activation))
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.relu(x)
        x = self.maxpool(x)

        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)

        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        x = self.fc(x)
        return x


# -----------------------------------------------------------------------------
# training (torchvision references/classification/train.py, shortened)


def accuracy(output, target, topk=(1,)):
    """Computes the accuracy over the k top predictions for the specified values of k"""
    with torch.inference_mode():
        maxk = max(topk)
        batch_size = target.size(0)
        if target.ndim == 2:
            target = target.max(dim=1)[1]

        _, pred = output.topk(maxk, 1, True, True)
        pred = pred.t()
        correct = pred.eq(target[None])

        res = []
        for k in topk:
            correct_k = correct[:k].flatten().sum(dtype=torch.float32)
            res.append(correct_k * (100.0 / batch_size))
        return res


def train_one_epoch(model, criterion, optimizer, data_loader, device, epoch, args, autocast):
    model.train()
    start = time.time()
    for i, (image, target) in enumerate(data_loader):
        if args.max_steps and i >= args.max_steps:
            break
        image, target = image.to(device), target.to(device)
        with autocast():
            output = model(image)
            loss = criterion(output, target)

        optimizer.zero_grad()
        loss.backward()
        if args.clip_grad_norm:
            nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        optimizer.step()

        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        if i % args.print_freq == 0:
            print(
                f"Epoch: [{epoch}] [{i}/{len(data_loader)}] loss: {loss.item():.4f} acc1: {acc1.item():.2f} "
                f"acc5: {acc5.item():.2f} lr: {optimizer.param_groups[0]['lr']:.4f} time: {time.time() - start:.2f}s"
            )


def main(args):
    print(args)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)

    transform = nn.Sequential(
        ToDtype(torch.float32),
        RandomCrop(args.image_size, padding=2),
        RandomHorizontalFlip(),
        Normalize(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), low_precision=args.bug == "norm-bf16"),
    )
    dataset = SyntheticImages(args.num_samples, args.num_classes, args.image_size, args.seed, transform=transform)
    data_loader = DataLoader(
        dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers, drop_last=True, pin_memory=False
    )

    print("Creating model")
    model = ResNet(widths=tuple(args.widths), num_classes=args.num_classes, bug=args.bug)
    model.to(device)

    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    parameters = [
        {"params": [p for n, p in model.named_parameters() if p.ndim > 1], "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if p.ndim <= 1], "weight_decay": 0.0},  # norms, biases
    ]
    optimizer = torch.optim.SGD(parameters, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    steps_per_epoch = min(len(data_loader), args.max_steps or math.inf)
    lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * steps_per_epoch)

    if args.dtype == "bfloat16":
        autocast = lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    else:
        autocast = lambda: torch.autocast(device_type=device.type, enabled=False)

    print("Start training")
    start_time = time.time()
    for epoch in range(args.epochs):
        train_one_epoch(model, criterion, optimizer, data_loader, device, epoch, args, autocast)
        lr_scheduler.step()
    print(f"Training time {time.time() - start_time:.1f}s")


def get_args_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("-b", "--batch-size", default=8, type=int)
    parser.add_argument("--epochs", default=1, type=int)
    parser.add_argument("--max-steps", default=3, type=int, help="iterations per epoch at most (0: all)")
    parser.add_argument("-j", "--workers", default=2, type=int, help="number of data loading workers")
    parser.add_argument("--num-samples", default=64, type=int)
    parser.add_argument("--num-classes", default=10, type=int)
    parser.add_argument("--image-size", default=16, type=int)
    parser.add_argument("--widths", default=[8, 16, 32], type=int, nargs=3)
    parser.add_argument("--lr", default=0.1, type=float)
    parser.add_argument("--momentum", default=0.9, type=float)
    parser.add_argument("--wd", "--weight-decay", default=1e-4, type=float, dest="weight_decay")
    parser.add_argument("--label-smoothing", default=0.0, type=float)
    parser.add_argument("--clip-grad-norm", default=None, type=float)
    parser.add_argument("--print-freq", default=1, type=int)
    parser.add_argument("--seed", default=0, type=int)
    parser.add_argument("--bug", default="none", choices=sorted(BUGS))
    return parser


if __name__ == "__main__":
    main(get_args_parser().parse_args())
