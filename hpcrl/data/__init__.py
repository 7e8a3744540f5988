"""Prompt datasets: synthetic arithmetic, local JSONL/Parquet files, Hugging Face datasets."""
