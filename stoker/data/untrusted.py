"""Checks of user values before they reach git or DVC: none may be read as an option.

A repository URL ``--upload-pack=touch /tmp/x`` or a revision ``--output=...`` given to git
becomes an option of git's, not a value. Stoker refuses such a value in one line naming its
field, and also passes ``--`` / ``--end-of-options`` before values on the command line.
"""

from __future__ import annotations

from stoker.runtime.listing import control_characters  # noqa: F401 - checks names too


def option_like(fields: dict[str, str | None]) -> str | None:
    """The message for the first value that starts with ``-`` (None when none does).

    Args:
        fields: config field name (``data.repo_url``) -> the user's value.

    Returns:
        One line naming the field and the value, or None.
    """
    for field, value in fields.items():
        if value is not None and value.lstrip().startswith("-"):
            instead = (f"give a path (./{value.lstrip()}) or a URL instead"
                       if field.endswith("repo_url") else "no such name starts with '-'")
            return (f"{field} {value!r}: starts with '-', which git and DVC would read as an "
                    f"option; {instead}")
    return None
