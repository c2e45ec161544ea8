/* SharedMap and map_shared (sharedmap.c): added to omni_plugins_shm._native at import. */
#ifndef OMNI_SHM_SHAREDMAP_H
#define OMNI_SHM_SHAREDMAP_H
#include <Python.h>

int sharedmap_add(PyObject *module);

#endif
