"""`layers.linear`: a product over many rows in row slices equals the one product."""
import pytest
import torch
import torch.nn.functional as F

from oasiskv.layers.linear import Linear, linear


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_row_slices_equal_one_product(bias, rows):
    torch.manual_seed(0)
    x, w = torch.randn(37, 24), torch.randn(16, 24)
    b = torch.randn(16) if bias else None
    assert torch.allclose(linear(x, w, b, max_rows=rows), F.linear(x, w, b), atol=1e-5)


def test_module_and_other_shapes_take_one_product():
    layer = Linear(8, 4)
    x = torch.randn(2, 3, 8)  # not 2-D: F.linear as is
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
