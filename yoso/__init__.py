"""YOSO attention: LSH Bernoulli sampling (custom backward), YOSO-E, and fast Hadamard hashing."""

from yoso.attention import yoso, yoso_c, yoso_e

__all__ = ["yoso", "yoso_c", "yoso_e"]
