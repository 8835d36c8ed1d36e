"""Offline GRPO tuning harness."""
