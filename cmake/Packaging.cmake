# Packaging: what `cmake --install` puts beside the programs, and the Debian package CPack makes
# from it. In the build directory, `cpack -G DEB` writes tsd_<version>_amd64.deb with tsd, tsctl,
# libtsclient and its headers (and a pkg-config file), the systemd unit, the config file and the
# maintainer scripts that create the `tsd` user and group (deploy/debian/). The package installs
# under /usr; the unit goes to /usr/lib/systemd/system, the config to /etc/tsd (a conffile).
# scripts/test-package.sh builds, installs, runs and removes it.

set(TSD_DEPLOY_DIR ${PROJECT_SOURCE_DIR}/deploy)

install(FILES ${TSD_DEPLOY_DIR}/tsd.service DESTINATION lib/systemd/system)
install(FILES ${TSD_DEPLOY_DIR}/tsd.toml DESTINATION /etc/tsd)
install(FILES ${TSD_DEPLOY_DIR}/debian/profile.sh DESTINATION /etc/profile.d RENAME tsd.sh)
install(FILES ${PROJECT_SOURCE_DIR}/README.md ${PROJECT_SOURCE_DIR}/docs/daemon.md
              ${PROJECT_SOURCE_DIR}/docs/deploy.md ${TSD_DEPLOY_DIR}/gpu-stores.conf
        DESTINATION share/doc/tsd)

set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
configure_file(${TSD_DEPLOY_DIR}/debian/tsclient.pc.in ${CMAKE_BINARY_DIR}/tsclient.pc @ONLY)
install(FILES ${CMAKE_BINARY_DIR}/tsclient.pc DESTINATION lib/pkgconfig)

set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME tsd)
set(CPACK_PACKAGE_VENDOR TrainStream)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY
    "TrainStream daemon: lends locked host memory to training processes")
set(CPACK_PACKAGE_DESCRIPTION
    "tsd owns a node's locked host memory and lends it to training processes,
which attach over a local socket and map it as file descriptors. Several jobs
share one pool with quotas. This package holds the daemon (tsd), its systemd
unit and configuration, the inspection tool (tsctl), and the C++ client
library (libtsclient) with its headers.")
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)  # tsd_<version>_<arch>.deb
set(CPACK_DEBIAN_PACKAGE_MAINTAINER "TrainStream engineers <tsd@trainstream.invalid>")
set(CPACK_DEBIAN_PACKAGE_SECTION admin)
set(CPACK_DEBIAN_PACKAGE_PRIORITY optional)
# Library dependencies come from dpkg-shlibdeps; adduser runs in postinst.
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS_PRIVATE_DIRS ${CMAKE_LIBRARY_OUTPUT_DIRECTORY})
set(CPACK_DEBIAN_PACKAGE_DEPENDS "adduser")
set(CPACK_DEBIAN_PACKAGE_SUGGESTS "libabsl-dev, pkg-config")
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS ON)  # also makes dpkg run ldconfig for libtsclient
set(CPACK_DEBIAN_PACKAGE_CONTROL_EXTRA
    ${TSD_DEPLOY_DIR}/debian/postinst ${TSD_DEPLOY_DIR}/debian/prerm
    ${TSD_DEPLOY_DIR}/debian/postrm ${TSD_DEPLOY_DIR}/debian/conffiles)
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)
set(CPACK_STRIP_FILES ON)
# Only what `install()` names: no source package, no tests.
set(CPACK_SOURCE_GENERATOR "")
include(CPack)
