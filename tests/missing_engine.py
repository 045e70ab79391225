"""An engine adapter whose library is not installed (the registry's EngineMissing path)."""

import gqakit_engine_library_that_is_not_installed  # noqa: F401
