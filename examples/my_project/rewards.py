"""A reward of this project's own, named in my_project.yaml as `rewards:close_enough`.

forge imports it from the directory you run from (or the config file's directory): no install,
no PYTHONPATH. A reward function gets the prompt, the response and the row's target as text.
"""


def close_enough(prompt: str, response: str, target: str) -> float:
    """1 for the exact sum, 0.5 for one that is off by one, 0 otherwise."""
    try:
        answer, expected = int(response.strip()), int(target.strip())
    except ValueError:
        return 0.0
    return {0: 1.0, 1: 0.5}.get(abs(answer - expected), 0.0)
