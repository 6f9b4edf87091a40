import mlx_dspark


def test_import():
    assert mlx_dspark.__doc__
