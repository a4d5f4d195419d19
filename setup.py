"""Maps the top-level folders core/, tui/ and widgets/ into the `workbench` namespace.

The product card fixes the top-level layout; nothing may install a top-level
package called `core`, so every sub-package is listed under `workbench.*` here.
"""

from setuptools import find_packages, setup

MAPPED = {"workbench": "workbench", "workbench.core": "core", "workbench.tui": "tui", "workbench.widgets": "widgets"}

packages, package_dir = [], {}
for name, folder in MAPPED.items():
    package_dir[name] = folder
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_packages(folder)]

# The CPU kernels' C sources (and their shared header) are compiled at first use, so they ship with the package.
setup(
    packages=packages,
    package_dir=package_dir,
    include_package_data=True,
    package_data={"workbench.core.layers.cpu_ops": ["*.c", "*.h"], "workbench.core.simulation": ["data/*.json"]},
)
