import os

from setuptools import find_packages, setup

here = os.path.dirname(os.path.abspath(__file__))
version = {}
with open(os.path.join(here, "dgt", "_version.py")) as f:
    exec(f.read(), version)
with open(os.path.join(here, "README.md"), encoding="utf-8") as f:
    long_description = f.read()

setup(
    name="dgt",
    version=version["__version__"],
    description="Differential Gradient Transmission for MXNet: important gradient blocks over "
                "TCP, the rest over prioritised lossy UDP",
    long_description=long_description,
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(include=["dgt", "dgt.*"]),
    python_requires=">=3.8",
    install_requires=["numpy", "pyzmq>=26.4", "ml_dtypes", "numba"],
    extras_require={
        # mxnet 1.9.1 imports only with numpy < 1.24 (np.bool was removed in 1.24).
        "mxnet": ["mxnet==1.9.1", "numpy<1.24"],
        "examples": ["mxnet==1.9.1", "numpy<1.24", "tqdm", "matplotlib"],
        "test": ["pytest", "pytest-timeout", "mxnet==1.9.1", "numpy<1.24", "tqdm", "matplotlib"],
    },
    entry_points={"console_scripts": ["dgt-launch=dgt.launch:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: System :: Distributed Computing",
    ],
)
