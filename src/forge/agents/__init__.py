"""Agents written against the OpenAI API, trained through forge's endpoint."""
