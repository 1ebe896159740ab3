"""The three models of the DGT paper, at the smallest input each works with.

GoogLeNet (Inception v1) is written here: MXNet 1.9.1's model zoo has no GoogLeNet.  It follows
the original layout (Szegedy et al. 2015) without the auxiliary classifiers and with global
average pooling, so it works for any input of at least 32x32.  AlexNet and VGG-11 come from the
zoo; AlexNet needs at least 63x63 input, VGG-11 32x32.
"""
from mxnet import init
from mxnet.gluon import nn
from mxnet.gluon.model_zoo import vision

INPUT_SIZE = {"googlenet": 32, "alexnet": 64, "vgg11": 32}
# VGG-11 has no batch norm: with Xavier's default (uniform, fan average) its eight ReLU conv
# layers shrink the signal until the loss stays at ln 10; He's init (gaussian, fan in, scale 2)
# keeps it.  Every other model keeps Xavier, the setting all their recorded runs used.
INIT = {"vgg11": init.Xavier(rnd_type="gaussian", factor_type="in", magnitude=2)}


class Inception(nn.HybridBlock):
    """Four parallel branches concatenated on channels: 1x1; 1x1-3x3; 1x1-5x5; pool-1x1."""

    def __init__(self, c1, c2, c3, c4, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.p1 = nn.Conv2D(c1, kernel_size=1, activation="relu")
            self.p2 = nn.HybridSequential()
            self.p2.add(nn.Conv2D(c2[0], kernel_size=1, activation="relu"),
                        nn.Conv2D(c2[1], kernel_size=3, padding=1, activation="relu"))
            self.p3 = nn.HybridSequential()
            self.p3.add(nn.Conv2D(c3[0], kernel_size=1, activation="relu"),
                        nn.Conv2D(c3[1], kernel_size=5, padding=2, activation="relu"))
            self.p4 = nn.HybridSequential()
            self.p4.add(nn.MaxPool2D(pool_size=3, strides=1, padding=1),
                        nn.Conv2D(c4, kernel_size=1, activation="relu"))

    def hybrid_forward(self, F, x):
        return F.concat(self.p1(x), self.p2(x), self.p3(x), self.p4(x), dim=1)


def googlenet(classes: int = 10) -> nn.HybridSequential:
    net = nn.HybridSequential(prefix="googlenet0_")
    with net.name_scope():
        net.add(nn.Conv2D(64, kernel_size=7, strides=2, padding=3, activation="relu"),
                nn.MaxPool2D(pool_size=3, strides=2, padding=1),
                nn.Conv2D(64, kernel_size=1, activation="relu"),
                nn.Conv2D(192, kernel_size=3, padding=1, activation="relu"),
                nn.MaxPool2D(pool_size=3, strides=2, padding=1),
                Inception(64, (96, 128), (16, 32), 32),
                Inception(128, (128, 192), (32, 96), 64),
                nn.MaxPool2D(pool_size=3, strides=2, padding=1),
                Inception(192, (96, 208), (16, 48), 64),
                Inception(160, (112, 224), (24, 64), 64),
                Inception(128, (128, 256), (24, 64), 64),
                Inception(112, (144, 288), (32, 64), 64),
                Inception(256, (160, 320), (32, 128), 128),
                nn.MaxPool2D(pool_size=3, strides=2, padding=1),
                Inception(256, (160, 320), (32, 128), 128),
                Inception(384, (192, 384), (48, 128), 128),
                nn.GlobalAvgPool2D(),
                nn.Dropout(0.4),
                nn.Dense(classes))
    return net


def get_model(name: str, classes: int = 10):
    if name == "googlenet":
        return googlenet(classes)
    if name in ("alexnet", "vgg11"):
        return vision.get_model(name, classes=classes)
    raise ValueError(f"unknown model {name!r}: googlenet, alexnet or vgg11")
