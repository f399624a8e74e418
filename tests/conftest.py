import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def hpcserve_home(tmp_path_factory) -> Path:
    """A private registry for the test session: tests never see the user's deployments."""
    home = tmp_path_factory.mktemp("hpcserve-home")
    mp = pytest.MonkeyPatch()
    mp.setenv("HPCSERVE_HOME", str(home))
    yield home
    mp.undo()
