# A package, so that pytest imports tests/conftest.py under the name the test modules import it by
# (tests.conftest): as a plain `conftest` it ran twice, and the second run saw the GPUs the first had hidden.
