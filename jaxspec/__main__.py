from jaxspec.cli import main

main()
