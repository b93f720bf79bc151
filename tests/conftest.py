"""Set-up shared by every test folder."""

import transformers.utils.logging as _hf_logging

# transformers binds its log handler to the sys.stderr of its first log call; under a test's
# capsys that stream is closed once the test ends, and every later transformers warning in the
# run then prints "--- Logging error ---" (which tests that check a command's stderr see).
# Configure it now, on the session's stderr.
_hf_logging.get_logger("transformers")
