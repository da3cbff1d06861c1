# What `cmake --install` puts where. A plain install: the header, the library (with its soname
# links), the JAX adapter where it is built, a CMake package (find_package(headloss) gives the
# imported target headloss::headloss) and headloss.pc for pkg-config. Under scikit-build-core
# (`pip install .`) the library and the adapter go into the Python package instead.
if(SKBUILD)
  # A wheel holds no symlinks: the real file under the soname, which both the package's loader
  # (headloss/libheadloss.so*) and the adapter's DT_NEEDED (through its $ORIGIN run path) find.
  install(FILES $<TARGET_FILE:headloss> DESTINATION ${SKBUILD_PROJECT_NAME}
          RENAME libheadloss.so.${PROJECT_VERSION_MAJOR})
  if(TARGET headloss_jax)
    install(TARGETS headloss_jax LIBRARY DESTINATION ${SKBUILD_PROJECT_NAME})
  endif()
  install(FILES ${HL_ABI_PY} DESTINATION ${SKBUILD_PROJECT_NAME})  # cmake/python_abi.cmake
  return()
endif()

include(CMakePackageConfigHelpers)
set(HL_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/headloss)
install(TARGETS headloss EXPORT headlossTargets LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(FILES ${PROJECT_SOURCE_DIR}/include/headloss.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
if(TARGET headloss_jax)
  install(TARGETS headloss_jax LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
endif()
install(EXPORT headlossTargets NAMESPACE headloss:: DESTINATION ${HL_CMAKE_DIR})
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/headlossConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/headlossConfig.cmake INSTALL_DESTINATION ${HL_CMAKE_DIR})
# The ABI is kept within a major version (descriptors grow by struct_size, SOVERSION = major).
write_basic_package_version_file(${PROJECT_BINARY_DIR}/headlossConfigVersion.cmake
                                 COMPATIBILITY SameMajorVersion)
install(FILES ${PROJECT_BINARY_DIR}/headlossConfig.cmake ${PROJECT_BINARY_DIR}/headlossConfigVersion.cmake
        DESTINATION ${HL_CMAKE_DIR})

# pkg-config: the prefix relative to the .pc file, so that `cmake --install --prefix <elsewhere>`
# (or a moved tree) still points at its own header and library.
set(HL_PC_DIR ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
if(IS_ABSOLUTE "${HL_PC_DIR}")
  set(HL_PC_PREFIX "${CMAKE_INSTALL_PREFIX}")
else()
  file(RELATIVE_PATH _hl_up "/${HL_PC_DIR}" "/")
  set(HL_PC_PREFIX "\${pcfiledir}/${_hl_up}")
endif()
configure_file(${CMAKE_CURRENT_LIST_DIR}/headloss.pc.in ${PROJECT_BINARY_DIR}/headloss.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/headloss.pc DESTINATION ${HL_PC_DIR})
