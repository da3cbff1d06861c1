# The Python package's view of the ABI (ctypes structures, enums, defines, the INIT macros'
# defaults), generated from include/headloss.h by tools/gen_abi.py whenever the header changes: the
# header is its only source. A checkout build writes python/headloss/_abi.py (gitignored), beside
# the package's sources; a pip build writes it into its build tree and installs it into the
# package (cmake/install.cmake).
if(DEFINED Python_EXECUTABLE)
  set(HL_ABI_PYTHON "${Python_EXECUTABLE}")  # the interpreter a pip build runs for
else()
  find_program(HL_ABI_PYTHON NAMES python3 python)
endif()
if(SKBUILD)
  set(HL_ABI_PY ${PROJECT_BINARY_DIR}/python/_abi.py)
else()
  set(HL_ABI_PY ${PROJECT_SOURCE_DIR}/python/headloss/_abi.py)
endif()
if(NOT HL_ABI_PYTHON)
  if(SKBUILD)
    message(FATAL_ERROR "headloss: no Python to generate ${HL_ABI_PY}")
  endif()
  message(STATUS "headloss: no Python found: ${HL_ABI_PY} (the Python package's ABI) is not generated")
  return()
endif()
add_custom_command(OUTPUT ${HL_ABI_PY}
  COMMAND ${HL_ABI_PYTHON} ${PROJECT_SOURCE_DIR}/tools/gen_abi.py ${PROJECT_SOURCE_DIR}/include/headloss.h
          -o ${HL_ABI_PY}
  DEPENDS ${PROJECT_SOURCE_DIR}/include/headloss.h ${PROJECT_SOURCE_DIR}/tools/gen_abi.py
  COMMENT "Generating the Python ABI module from include/headloss.h" VERBATIM)
add_custom_target(headloss_python_abi DEPENDS ${HL_ABI_PY})
add_dependencies(headloss headloss_python_abi)  # built with the library the package loads
