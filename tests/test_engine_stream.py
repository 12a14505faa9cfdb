"""The Docker Engine's own message reaches the user when a build or push stream reports its
failure only in ``errorDetail`` (issue 46). The Engine cannot be made to send that shape on
demand, so the real ``build``/``push`` read a stand-in of the Engine API client that yields the
stream exactly as the Engine API documents it (``docker.APIClient`` with ``decode=True``)."""

from __future__ import annotations

import pytest
from image_support import ENTRY

from stoker.images.build import ImageBuildError, PushRejectedError, build, push
from stoker.images.spec import ImageSpec, load_matrix
from stoker.images.stream import build_cause, engine_error, shortened

MESSAGE = "failed to solve: process \"/bin/sh -c false\" did not complete successfully"
ONLY_DETAIL = {"errorDetail": {"code": 1, "message": MESSAGE}}


class EngineStream:
    """``docker.APIClient``'s build/push answering with a fixed decoded JSON stream."""

    def __init__(self, *chunks: dict):
        self.chunks = chunks

    def build(self, **_):
        return iter(self.chunks)

    def push(self, *_, **__):
        return iter(self.chunks)


def test_build_failure_only_in_error_detail_names_the_engine_message():
    stream = EngineStream({"stream": "Step 1/2 : FROM base\n"}, ONLY_DETAIL)
    with pytest.raises(ImageBuildError) as e:
        build(stream, ImageSpec(entry=load_matrix().entry(ENTRY)), "127.0.0.1:5000/x:1", {},
              lambda line: None)
    assert MESSAGE in str(e.value) and "code 1" in str(e.value)
    assert "without an image id" not in str(e.value)


def test_push_failure_only_in_error_detail_names_the_engine_message():
    stream = EngineStream({"status": "The push refers to repository [127.0.0.1:5000/x]"},
                          {"errorDetail": {"message": "blob upload unknown"}})
    with pytest.raises(PushRejectedError) as e:
        push(stream, "127.0.0.1:5000/x:1", None, lambda line: None)
    assert "blob upload unknown" in str(e.value) and "127.0.0.1:5000" in str(e.value)
    assert "no digest" not in str(e.value)


@pytest.mark.parametrize("chunk, expected", [
    ({"error": " boom \n", "errorDetail": {"message": "boom"}}, "boom"),
    ({"errorDetail": {"message": "", "code": 2}}, "(no message) (code 2)"),
    ({"errorDetail": "plain"}, "plain"),
    ({"stream": "ok"}, None),
    ({"error": ""}, None),
])
def test_engine_error_reads_both_shapes(chunk, expected):
    assert engine_error(chunk) == expected


LONG_RUN = ("The command '/bin/sh -c set -eu;     case \"${X}\" in       wheelhouse) "
            "a=\"--no-index --find-links /tmp/build/wheelhouse\" ;;     esac;     "
            "/opt/stoker/venv/bin/pip install --no-cache-dir --disable-pip-version-check "
            "--progress-bar off ${a} "
            "\"torch==9.9.9\" -r /tmp/build/requirements-runtime.txt' returned a non-zero code: 1")


def test_a_failed_run_step_is_cut_and_its_cause_named():
    """The legacy builder's error repeats the whole RUN line; the reason is pip's last ERROR."""
    stream = EngineStream(
        {"stream": "Step 9/14 : RUN set -eu; ...\n"},
        {"stream": "ERROR: Could not find a version that satisfies the requirement torch==9.9.9"
                   " (from versions: 2.13.0)\n"},
        {"stream": "ERROR: No matching distribution found for torch==9.9.9\n"},
        {"error": LONG_RUN, "errorDetail": {"code": 1, "message": LONG_RUN}})
    with pytest.raises(ImageBuildError) as e:
        build(stream, ImageSpec(entry=load_matrix().entry(ENTRY)), "127.0.0.1:5000/x:1", {},
              lambda line: None)
    first, *tail = str(e.value).splitlines()
    assert first == ("build of 127.0.0.1:5000/x:1 failed: The command '/bin/sh -c set -eu; case "
                     "\"${X}\" in wheelhouse) a=\"--no-index --find-links /tmp/build/wheelh…' "
                     "returned a non-zero code: 1 (ERROR: No matching distribution found for "
                     "torch==9.9.9)")
    assert tail[-1] == "ERROR: No matching distribution found for torch==9.9.9"


@pytest.mark.parametrize("lines, cause", [
    (["Reading package lists...", "E: Unable to locate package python3.99"],
     "E: Unable to locate package python3.99"),
    (["error: externally-managed-environment", "note: see PEP 668"],
     "error: externally-managed-environment"),
    (["\x1b[91mERROR: No matching distribution found for torch==9.9.9\n\x1b[0m"],
     "ERROR: No matching distribution found for torch==9.9.9"),  # red, as the Engine sends it
    (["WARNING: Retrying (Retry(total=4)) after connection broken by 'SSLError(SSLCertVerif"
      "icationError(1, '[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: self-signed"
      " certificate in certificate chain (_ssl.c:1006)'))': /simple/torch/",
      "Could not fetch URL https://pypi.org/simple/torch/: There was a problem confirming the "
      "ssl certificate: HTTPSConnectionPool(host='pypi.org', port=443): Max retries exceeded "
      "with url: /simple/torch/ (Caused by SSLError(SSLCertVerificationError(1, '[SSL: CERTIFI"
      "CATE_VERIFY_FAILED] certificate verify failed: self-signed certificate in certificate "
      "chain (_ssl.c:1006)'))) - skipping",
      "ERROR: Could not find a version that satisfies the requirement torch==2.13.0",
      "ERROR: No matching distribution found for torch==2.13.0"],
     "ERROR: No matching distribution found for torch==2.13.0; pypi.org was not reached "
     "(certificate verify failed: self-signed certificate in certificate chain)"),
    (["Looking in indexes: https://download.pytorch.org/whl/cpu",
      "WARNING: Retrying after connection broken by 'NewConnectionError(': Failed to establish "
      "a new connection: [Errno -2] Name or service not known')': /whl/cpu/torch/",
      "ERROR: No matching distribution found for torch==2.13.0"],
     "ERROR: No matching distribution found for torch==2.13.0; a package index was not "
     "reached (Name or service not known)"),
    (["Step 3/4 : RUN false"], None),
    (["Errors are counted", "no errors"], None),
])
def test_build_cause_is_the_last_line_that_says_why(lines, cause):
    assert build_cause(lines) == cause


def test_a_short_command_is_kept_whole():
    assert shortened(MESSAGE) == MESSAGE


def test_build_output_lines_come_without_colour_codes_or_blank_resets():
    """Trial: half of a failed build's tail were empty lines (the legacy builder's colour
    resets), and the Prefect log lines kept the escape codes."""
    from stoker.images.build import _lines

    chunk = {"stream": "\x1b[91mERROR: No matching distribution found for torch==9.9.9\n"
                       "\x1b[0m\n\x1b[91m\n\x1b[0mStep 4/5 : RUN true\n"}
    assert list(_lines(chunk)) == ["ERROR: No matching distribution found for torch==9.9.9",
                                   "Step 4/5 : RUN true"]
