// A frozen leader is replaced and fenced, LEASE_MODE=kubernetes (Kubernetes Lease, against the test kit's fake API server):
// see lib/freeze.js.
import { freezeSuite } from './lib/freeze.js'

freezeSuite('kubernetes')
