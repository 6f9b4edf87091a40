# isort: off
import mlx_dspark  # noqa: F401  (first: it loads a system OpenBLAS before mlx.core)

# isort: on
import mlx.core as mx
import pytest
from mlx_lm import load as mlx_lm_load
from tiny_families import quantized_copy, save_family

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


@pytest.fixture(scope="session")
def family(tmp_path_factory):
    """(model, tokenizer, directory) of a family, float or quantized, built once."""
    root = tmp_path_factory.mktemp("families")
    built = {}

    def get(model_type: str, bits: int | None = None):
        key = (model_type, bits)
        if key not in built:
            path = root / model_type
            if not path.exists():
                save_family(path, model_type)
            if bits is not None:
                path = quantized_copy(path, root / f"{model_type}-q{bits}", bits)
            model, tokenizer = mlx_lm_load(str(path))
            built[key] = (model, tokenizer, path)
        return built[key]

    return get
