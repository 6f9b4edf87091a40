# isort: off
import mlx_dspark  # noqa: F401  (first: it loads a system OpenBLAS before mlx.core)

# isort: on
import mlx.core as mx
import pytest

from mlx_dspark.loading import load
from mlx_dspark.pairs.structured import PairSpec, build_structured_pair

HEADS = ["vanilla", "gated", "rnn", None]


def head_id(head):
    return head or "none"


@pytest.fixture(scope="session")
def pair_factory(tmp_path_factory):
    """Build (once) and load a structured pair for a spec."""
    built = {}

    def make(**fields):
        spec = PairSpec(**fields)
        key = repr(spec)
        if key not in built:
            directory = tmp_path_factory.mktemp("pair")
            target_dir, drafter_dir = build_structured_pair(directory, spec)
            model, tokenizer, drafter = load(target_dir, drafter_dir)
            built[key] = (model, tokenizer, drafter, target_dir, drafter_dir, spec)
        return built[key]

    return make


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory):
    """Cost profiles and calibrations measured by the tests stay out of the
    user's cache (tests that need an empty one set their own)."""
    patch = pytest.MonkeyPatch()
    patch.setenv("MLX_DSPARK_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield
    patch.undo()


@pytest.fixture(autouse=True)
def _fresh_random_state():
    mx.random.seed(0)
