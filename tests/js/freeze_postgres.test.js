// A frozen leader is replaced and fenced, LEASE_MODE=postgres (Postgres lease row):
// see lib/freeze.js.
import { freezeSuite } from './lib/freeze.js'

freezeSuite('postgres')
