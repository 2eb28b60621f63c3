"""Sparse gradients (torch ``nn.Embedding(sparse=True)``) as the dense ones hvd_quant reduces
(hvd_quant.torch.sparse); the optimizers' use of it runs under Horovod in
tests/test_optimizers_mp.py, the TensorFlow side in tests/test_tf_kernels.py."""

import pytest

torch = pytest.importorskip("torch")

from hvd_quant.torch.sparse import copy_into, dense  # noqa: E402


def sparse_grad():
    emb = torch.nn.Embedding(6, 3, sparse=True)
    emb(torch.tensor([4, 1, 4, 0])).pow(2).sum().backward()  # row 4 twice: uncoalesced
    return emb.weight.grad


def test_a_sparse_gradient_is_its_dense_value():
    g = sparse_grad()
    want = g.coalesce().to_dense()
    torch.testing.assert_close(dense(g, "emb.weight", g.numel(), True, "here"), want, rtol=0, atol=0)
    flat = torch.full((g.numel(),), float("nan"))
    copy_into(flat, g)  # over stale contents, without a dense temporary
    torch.testing.assert_close(flat, want.reshape(-1), rtol=0, atol=0)
    dense_g = torch.randn(4, 2)
    assert dense(dense_g, "w", 8, False, "here") is dense_g and dense(None, "w", 8, False, "here") is None


def test_sparse_as_dense_false_refuses_with_the_cost_it_would_take():
    g = sparse_grad()
    with pytest.raises(RuntimeError, match=r"emb\.weight is sparse.*ZeroOneAdam has sparse_as_dense=False.*7.2e-05 MB"):
        dense(g, "emb.weight", 18, False, "ZeroOneAdam")
