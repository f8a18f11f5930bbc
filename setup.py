"""Maps the top-level folders under the one import name ``prismgate``.

``codecs`` cannot be a top-level package (it is a standard-library module), so the
folders the architecture names are installed as ``prismgate`` (gateway/),
``prismgate.codecs``, ``prismgate.engines``, ``prismgate.instruments`` and ``prismgate.schemas``.
"""

from setuptools import find_packages, setup

ROOTS = {
    "prismgate": "gateway",
    "prismgate.codecs": "codecs",
    "prismgate.engines": "engines",
    "prismgate.instruments": "instruments",
    "prismgate.schemas": "schemas",
}

packages = []
for name, folder in ROOTS.items():
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=ROOTS)
