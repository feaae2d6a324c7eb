"""Prompts and answers: the built-in task, JSONL files, datasets, chat templates, the prompt stream."""
