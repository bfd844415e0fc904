import torch

from cacheblend_rag.metrics import next_token_kl, normalize_answer, qa_f1, token_f1


def test_f1_normalises_like_longbench():
    assert normalize_answer("The  Exeter College!") == "exeter college"
    assert token_f1("Exeter College", "exeter college") == 1.0
    assert token_f1("at Exeter", "Exeter College") == 0.5
    assert qa_f1("Paris", ["London", "paris"]) == 1.0
    assert qa_f1("", ["x"]) == 0.0


def test_kl_is_zero_for_equal_and_positive_otherwise():
    a = torch.randn(50)
    assert abs(next_token_kl(a, a)) < 1e-6
    assert next_token_kl(a, a.flip(0)) > 0.01


def test_kl_of_distributions_equal_up_to_rounding_is_never_negative():
    torch.manual_seed(0)
    for _ in range(200):
        a = torch.randn(49152) * 8
        b = a + torch.randn(49152) * 1e-6  # differences far below float32's resolution of the sum
        assert next_token_kl(a, b) >= 0.0
