"""Package metadata comes from settings.ini (nbdev 2's single source); this file only reads it."""
from configparser import ConfigParser

from setuptools import find_packages, setup

cfg = ConfigParser(delimiters=["="])
cfg.read("settings.ini", encoding="utf-8")
c = cfg["DEFAULT"]

setup(
    name=c["lib_name"],
    version=c["version"],
    description=c["description"],
    author=c["author"],
    license="Apache-2.0",
    python_requires=f">={c['min_python']}",
    packages=find_packages(include=["pith_lit", "pith_lit.*"]),
    install_requires=c["requirements"].split(),
    extras_require={"dev": c["dev_requirements"].split()},
    entry_points={"nbdev": [f"{c['lib_path']}={c['lib_path']}._modidx:d"]},
    zip_safe=False,
)
