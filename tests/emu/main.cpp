// test_emu's main: doctest's, over every tests/emu/test_emu_*.cpp (CMakeLists.txt
// registers each file with ctest as its own test).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
