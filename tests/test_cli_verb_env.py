"""A verb's environment defaults (`cli.VERB_ENV`) are set before its module, and torch, are
imported; a value the user set wins."""

from __future__ import annotations

import os
import subprocess
import sys

import click

from gqakit import cli


def test_convert_sets_its_environment_defaults_and_keeps_the_users(monkeypatch):
    ctx = click.Context(cli.cli)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert cli.cli.get_command(ctx, "convert") is not None
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    cli.cli.get_command(ctx, "convert")
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def test_the_defaults_come_before_torch_is_imported():
    code = ("import os, sys, click; from gqakit import cli; assert 'torch' not in sys.modules; "
            "cli.cli.get_command(click.Context(cli.cli), 'convert'); import torch; "
            "print(os.environ['OMP_WAIT_POLICY'])")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip() == "PASSIVE"
