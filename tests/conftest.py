import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "presets: a GPU preset's main job, minutes each (benchmarks/"
                            "run_graphed_presets_device.sh; left out of the GPU suite's parts)")
    # One process compiles the node kernels for dozens of model configs (a run has one),
    # each a graph of its own: past dynamo's default limit of 8 per function a
    # fullgraph region fails instead of compiling the next config.
    torch._dynamo.config.recompile_limit = 64


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def seeded_rng(request):
    """Random inputs differ from test to test but repeat from run to run."""
    import zlib

    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


WORKING_FOLDER = pytest.StashKey[tuple]()


def _start_the_readmes_first_command(config) -> tuple:
    """``(folder, Popen)``: the main job started in a new working folder (fewer steps)."""
    folder = config._tmp_path_factory.mktemp("working-folder")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-m", "fmoe.train", "--steps", "2", "--batch", "4", "--seq", "32",
                             "--eval-every", "2", "--eval-batches", "1", "--sample-tokens", "4", "--no-progress"],
                            cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    config.stash[WORKING_FOLDER] = folder, proc
    return folder, proc


def pytest_sessionstart(session):
    """Start the job of ``a_working_folder_where_the_main_job_ran`` at once: its seconds
    of start-up run on one core while the collection runs on the other."""
    if not session.config.option.collectonly:
        _start_the_readmes_first_command(session.config)


def pytest_sessionfinish(session):
    folder, proc = session.config.stash.get(WORKING_FOLDER, (None, None))
    if proc is not None and proc.poll() is None:  # no test ran, or it overran
        proc.kill()
        proc.communicate()


@pytest.fixture(autouse=True, scope="session")
def a_working_folder_where_the_main_job_ran(pytestconfig):
    """The suite runs in a folder where README's first command has just run (fewer
    steps): the main job's default ``--out`` there holds a run. A test that leans on
    the working folder or on that default fails here as it would after that command."""
    folder, proc = pytestconfig.stash.get(WORKING_FOLDER, None) or _start_the_readmes_first_command(pytestconfig)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0 and (folder / "runs" / "fmoe-lm" / "checkpoint").exists(), stderr
    before = os.getcwd()
    os.chdir(folder)
    yield folder
    os.chdir(before)
